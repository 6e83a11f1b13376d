"""Federated WordPiece vocabulary (fedssl.data.vocab): what a site shares, the server's validation, the vocabulary
layout, WordPiece tokenisation and vocab.txt round trips, against hand-computed expectations."""

from __future__ import annotations

import pytest
import torch

from fedssl.data.vocab import (
    SPECIAL_TOKENS,
    _is_word,
    basic_words,
    build_wordpiece_vocab,
    load_vocab,
    make_tokenizer,
    merge_word_counts,
    save_vocab,
    site_word_counts,
    tokenize,
)


def test_basic_words_is_berts_basic_tokenisation():
    assert basic_words("Héllo, WORLD!  pneumo-thorax 3.5cm\t") == \
        ["hello", ",", "world", "!", "pneumo", "-", "thorax", "3", ".", "5cm"]
    assert basic_words("") == []


def test_only_words_of_at_least_min_count_texts_leave_the_site():
    texts = ["Small effusion."] * 5 + ["Edema."] * 4 + ["Smithers " * 6]  # a name repeated 6 times in ONE text
    texts += ["x" * 32 + " " + "y" * 33] * 5
    # effusion, small, "." in 5+ texts; edema in 4; smithers in 1 (6 occurrences); 33 y's too long
    assert site_word_counts(texts) == {".": 9, "effusion": 5, "small": 5, "x" * 32: 5}
    assert site_word_counts(texts, min_count=4) == {".": 9, "edema": 4, "effusion": 5, "small": 5, "x" * 32: 5}
    assert site_word_counts(texts, max_words=2) == {".": 9, "effusion": 5}  # ties alphabetical
    with pytest.raises(ValueError, match="min_count=0"):
        site_word_counts(texts, min_count=0)
    with pytest.raises(ValueError, match="not one string"):
        site_word_counts("effusion")


def test_merge_sums_sites_and_names_a_malformed_site():
    a = {"effusion": 9, "edema": 5, ".": 20}
    b = {"effusion": 6, "opacity": 7, ".": 11}
    # each site's counts rescaled to a total of 10**6 (a: 34, b: 24), then summed:
    # "." 20/34 + 11/24 -> 588235 + 458333; effusion 9/34 + 6/24 -> 264706 + 250000; opacity 7/24; edema 5/34
    assert merge_word_counts([a, b]) == {".": 1046568, "effusion": 514706, "opacity": 291667, "edema": 147059}
    assert merge_word_counts([a, b], min_sites=2) == {".": 1046568, "effusion": 514706}
    assert merge_word_counts([a, b], max_words=3) == {".": 1046568, "effusion": 514706, "opacity": 291667}
    for bad, what in [({"edema": 2}, "count 2"), ({"two words": 6}, "'two words'"), ({"Edema": 6}, "'Edema'"),
                      ({"a" * 33: 6}, "a" * 33), ({"edema": 6.0}, "count 6.0"), ({"edema": True}, "count True"),
                      (["edema"], "list")]:
        with pytest.raises(ValueError, match=f"site 1 sent.*{what}"):
            merge_word_counts([a, bad, b])
    with pytest.raises(ValueError, match="site 0 sent 3 words"):
        merge_word_counts([a], max_site_words=2)
    with pytest.raises(ValueError, match="min_sites=3"):
        merge_word_counts([a, b], min_sites=3)


def test_vocabulary_layout_is_exact_and_deterministic():
    counts = {"on": 5, "no": 5, "ox": 3, ".": 9}  # "no" / "on" tie: alphabetical, whatever the dict order
    base = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "n", "o", "x", "##.", "##n", "##o", "##x"]
    assert build_wordpiece_vocab(counts, 18) == base + ["no", "on", "ox", "[unused0]", "[unused1]"]
    assert build_wordpiece_vocab(counts, 14) == base + ["no"]
    reordered = dict(reversed(list(counts.items())))
    assert build_wordpiece_vocab(reordered, 18) == build_wordpiece_vocab(counts, 18)
    # too small for every character: the rarest ("x", count 3) and its word are left out, the build goes on
    assert build_wordpiece_vocab(counts, 12) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "n", "o", "##.",
                                                  "##n", "##o", "no"]
    with pytest.raises(ValueError, match="vocab_size=6.*need 7 entries"):
        build_wordpiece_vocab(counts, 6)
    # pieces after the whole words: word starts and ## suffixes scored by summed counts, ties alphabetical
    vocab = build_wordpiece_vocab({"abcd": 2, "abce": 1}, 20)
    assert len(vocab) == 20 and tuple(vocab[:5]) == SPECIAL_TOKENS
    assert vocab[15:] == ["abcd", "abce", "ab", "abc", "##bcd"]


@pytest.fixture(scope="module")
def vocab():
    counts = {"pneumothorax": 10, "effusion": 8, "no": 12, ".": 20}
    return build_wordpiece_vocab(counts, 5 + 2 * 15 + 3)  # 14 letters and ".", 3 words: no pieces


def test_wordpiece_tokenisation(vocab):
    tok = make_tokenizer(vocab)
    special_ids = (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id)
    assert special_ids == (0, 1, 2, 3, 4)

    def pieces(text):
        ids = tok(text)["input_ids"]
        assert ids[0] == 2 and ids[-1] == 3
        return tok.convert_ids_to_tokens(ids[1:-1])

    assert pieces("No Pneumothorax.") == ["no", "pneumothorax", "."]
    assert tok("pneumothorax")["input_ids"] == [2, vocab.index("pneumothorax"), 3]  # a vocabulary word: one id
    assert pieces("tumor") == ["t", "##u", "##m", "##o", "##r"]  # unseen word of seen characters
    assert pieces("none") == ["no", "##n", "##e"]  # greedy longest match
    assert pieces("ok") == ["[UNK]"]  # "k" was never seen


def test_tokenize_pads_truncates_and_masks(vocab):
    tok = make_tokenizer(vocab)
    no, px, dot = vocab.index("no"), vocab.index("pneumothorax"), vocab.index(".")
    ids, mask = tokenize(tok, ["no pneumothorax.", "no no no no no"], 6)
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == [[2, no, px, dot, 3, 0], [2, no, no, no, no, 3]]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    ids, mask = tokenize(tok, ["no"], 6)  # padded to max_length, not to the longest text
    assert ids.tolist() == [[2, no, 3, 0, 0, 0]] and mask.tolist() == [[1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="max_length=1"):
        tokenize(tok, ["no"], 1)
    with pytest.raises(ValueError, match="texts="):
        tokenize(tok, "no", 6)


def test_vocab_round_trips_through_files_and_folders(vocab, tmp_path):
    path = tmp_path / "vocab.txt"
    save_vocab(vocab, path)
    assert path.read_text(encoding="utf-8").split("\n")[:6] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
    assert load_vocab(path) == vocab
    texts = ["no effusion.", "none tumor ok"]
    expected = tokenize(make_tokenizer(vocab), texts, 12)
    for tok in (make_tokenizer(path=str(path)),):
        assert all(torch.equal(a, b) for a, b in zip(tokenize(tok, texts, 12), expected))
    folder = tmp_path / "tokenizer"
    make_tokenizer(vocab).save_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(tokenize(make_tokenizer(path=str(folder)), texts, 12), expected))
    broken = tmp_path / "broken.txt"
    broken.write_text("[PAD]\n\n[UNK]\n", encoding="utf-8")
    with pytest.raises(ValueError, match="broken.txt line 2"):
        load_vocab(broken)
    with pytest.raises(ValueError, match="missing \\['\\[CLS\\]'"):
        make_tokenizer(["[PAD]", "[UNK]", "[SEP]", "[MASK]", "a"])
    with pytest.raises(ValueError, match="exactly one of vocab"):
        make_tokenizer(vocab, path=str(path))


def test_one_site_cannot_fill_or_break_the_vocabulary():
    """Issue 45: 1,100 made-up words sent with count 10**12 filled 955 of 1,024 entries; 15,300 one-character words
    made the build raise before round 0.  Each site's counts now weigh the same and the characters are bounded."""
    honest_words = [f"w{a}{b}" for a in "abcdefghij" for b in "klmnopqrst"]  # 100 words of 3 letters
    honest = [{w: 50 + 3 * i + s for i, w in enumerate(honest_words)} for s in range(4)]
    flood = {f"zq{i}": 10**12 for i in range(1100)}
    vocab = build_wordpiece_vocab(merge_word_counts(honest + [flood]), 1024)
    assert set(honest_words) <= set(vocab)  # every honest word keeps its place
    # the made-up words only fill what is left after every honest word (before: they came first)
    assert max(vocab.index(w) for w in honest_words) < min(i for i, t in enumerate(vocab) if t.startswith("zq"))
    letters = [chr(c) for c in range(0x100, 0xD800) if _is_word(chr(c))][:15300]
    assert len(letters) == 15300
    chars = {c: 5 for c in letters}
    vocab = build_wordpiece_vocab(merge_word_counts(honest + [chars]), 1024)
    assert len(vocab) == 1024 and set(honest_words) <= set(vocab)
    assert sum(1 for t in vocab if t.lstrip("#") in chars) <= 0.25 * 1024
