"""A WordPiece text vocabulary for federated vision-language pre-training, built without raw text leaving a site.

FedDRA (Shuai, Wu, Tang & Shen, "Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training
Under Data Heterogeneity", TMLR) encodes reports with BERT-base (Devlin et al., "BERT: Pre-training of Deep
Bidirectional Transformers for Language Understanding", NAACL 2019) and its WordPiece vocabulary (Wu et al., "Google's
Neural Machine Translation System", arXiv 2016).  When no pre-trained BERT folder is at hand (no download here), the
vocabulary is built inside the federation:

1. each site runs :func:`site_word_counts` on its own reports and sends the resulting ``{word: count}`` dict;
2. the server validates and merges the dicts (:func:`merge_word_counts`) and builds the vocabulary
   (:func:`build_wordpiece_vocab`), which every site then uses through :func:`make_tokenizer` / :func:`tokenize`.

What a site shares (and nothing else): for every word - a token of BERT's basic tokenisation (:func:`basic_words`:
lower-cased, accents stripped, split on whitespace and punctuation, each punctuation mark a word) of at most
:data:`MAX_WORD_CHARS` characters - that occurs in at least ``min_count`` DIFFERENT texts of the site, the word and its
total number of occurrences at the site.  A word of fewer texts (a name, an accession number, a rare finding that
could single out a patient) never leaves the site, nor does any text, word order, text length or text count (beyond
what the occurrence counts imply).  The threshold counts texts, not occurrences, so a word repeated within one report
does not pass.  Several reports of one patient count as several texts: raise ``min_count`` where patients have many
studies.  Counts are exact (no noise).

Special tokens take ids 0..4 in the order of :data:`SPECIAL_TOKENS` (``[PAD]`` = 0 as in BERT, then ``[UNK]``,
``[CLS]``, ``[SEP]``, ``[MASK]``; BERT's own vocab.txt has them at 0 and 100..103).  A vocabulary loaded from another
vocab.txt only needs to contain the five tokens, wherever they are.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Iterable, Mapping, Sequence

import torch
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from fedssl.core.checks import require, require_int

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
#: the longest word a site shares (longer "words" are identifiers rather than vocabulary)
MAX_WORD_CHARS = 32
#: a site shares a word only if at least this many of its texts contain it
DEFAULT_MIN_COUNT = 5
#: the most words one site may send (the server refuses a larger dict)
MAX_SITE_WORDS = 100_000
#: the most words the merged dict keeps (the most frequent ones)
MAX_MERGED_WORDS = 50_000
#: an implausible occurrence count (the server refuses it)
MAX_COUNT = 10**12
#: longest ``##`` / word-start piece considered by :func:`build_wordpiece_vocab`
_MAX_PIECE_CHARS = 8
#: every site's counts are rescaled to this total before they are summed: each site has the same say
SITE_MASS = 10**6
#: at most this share of the vocabulary goes to characters (plain and ``##``); the rarest characters, and the words
#: that contain them, are left out beyond it, except the characters that each hold CORE_CHAR_SHARE of the summed
#: counts (at most 100 of them: the alphabet of the reports, kept whatever the vocabulary size)
MAX_CHAR_SHARE = 0.25
CORE_CHAR_SHARE = 0.01

_NORMALIZER = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True)
_PRE_TOKENIZER = pre_tokenizers.BertPreTokenizer()
_SIMPLE_WORD = re.compile(r"^[a-z0-9]+$")


def basic_words(text: str) -> list[str]:
    """BERT's basic tokenisation (the very normaliser and pre-tokeniser of :func:`make_tokenizer`): control characters
    removed, CJK characters split, lower-cased, accents stripped (NFD, combining marks dropped), split on whitespace
    and punctuation, every punctuation character its own word.  ``"No pneumo-thorax."`` ->
    ``["no", "pneumo", "-", "thorax", "."]``."""
    require(isinstance(text, str), "basic_words", "text", type(text).__name__, "pass a string")
    return [w for w, _ in _PRE_TOKENIZER.pre_tokenize_str(_NORMALIZER.normalize_str(text))]


def _is_word(word: object) -> bool:
    """A string the basic tokeniser outputs as one word (a fixed point) of 1..MAX_WORD_CHARS characters."""
    if not isinstance(word, str) or not 0 < len(word) <= MAX_WORD_CHARS:
        return False
    return bool(_SIMPLE_WORD.match(word)) or basic_words(word) == [word]


def site_word_counts(texts: Iterable[str], min_count: int = DEFAULT_MIN_COUNT,
                     max_words: int = MAX_SITE_WORDS) -> dict[str, int]:
    """The one thing a site shares for the vocabulary (see the module docstring): ``{word: occurrences}`` for the words
    of at most :data:`MAX_WORD_CHARS` characters contained in at least ``min_count`` of ``texts``; at most
    ``max_words`` of them (the most frequent; ties alphabetical), ordered by count, then alphabetically."""
    name = "site_word_counts"
    require(not isinstance(texts, (str, bytes)), name, "texts", str(texts)[:40], "pass a list of texts, not one string")
    require_int(name, "min_count", min_count, 1, f"pass the minimum number of texts containing a shared word "
                f"(default {DEFAULT_MIN_COUNT}; 1 shares every word)")
    require_int(name, "max_words", max_words, 1, f"pass a positive integer (at most {MAX_SITE_WORDS} are accepted)")
    occurrences: Counter[str] = Counter()
    documents: Counter[str] = Counter()
    for i, text in enumerate(texts):
        require(isinstance(text, str), name, f"texts[{i}]", type(text).__name__, "every text must be a string")
        words = basic_words(text)
        occurrences.update(words)
        documents.update(set(words))
    kept = [w for w, d in documents.items() if d >= min_count and _is_word(w)]
    kept.sort(key=lambda w: (-occurrences[w], w))
    return {w: occurrences[w] for w in kept[:max_words]}


def merge_word_counts(counts_list: Sequence[Mapping[str, int]], min_sites: int = 1,
                      max_words: int = MAX_MERGED_WORDS, min_count: int = DEFAULT_MIN_COUNT,
                      max_site_words: int = MAX_SITE_WORDS) -> dict[str, int]:
    """Server side: validate every site's dict, rescale its counts to a total of :data:`SITE_MASS` (each site has
    the same say, whatever counts it claims: one site sending 10**12 for its words cannot crowd out the others'; a
    site's rescaled count is at least 1) and sum the counts of the words reported by at least ``min_sites`` sites;
    the ``max_words`` most frequent are kept (ties alphabetical), ordered by count, then alphabetically.

    A site's dict must hold at most ``max_site_words`` entries, each a word the basic tokeniser outputs as itself of
    1..:data:`MAX_WORD_CHARS` characters, with an integer count in ``[min_count, 10**12]``; anything else raises a
    ValueError naming the site index (the dict of a site that skipped the ``min_count`` filter is refused)."""
    name = "merge_word_counts"
    require(isinstance(counts_list, (list, tuple)) and len(counts_list) > 0, name, "counts_list",
            type(counts_list).__name__, "pass a non-empty list with one {word: count} dict per site")
    require_int(name, "min_sites", min_sites, 1, f"pass 1..{len(counts_list)} (the number of sites)")
    require(min_sites <= len(counts_list), name, "min_sites", min_sites,
            f"at most the number of sites ({len(counts_list)})")
    require_int(name, "max_words", max_words, 1, "pass a positive integer")
    require_int(name, "min_count", min_count, 1, "pass the sites' min_count (site_word_counts)")
    require_int(name, "max_site_words", max_site_words, 1, "pass a positive integer")
    total: Counter[str] = Counter()
    sites: Counter[str] = Counter()
    for i, counts in enumerate(counts_list):
        where = f"site {i}"
        if not isinstance(counts, Mapping):
            raise ValueError(f"{name}: {where} sent a {type(counts).__name__}, not a {{word: count}} dict; "
                             "send the output of site_word_counts")
        if len(counts) > max_site_words:
            raise ValueError(f"{name}: {where} sent {len(counts)} words, more than max_site_words={max_site_words}; "
                             "send the output of site_word_counts (which caps it)")
        for word, count in counts.items():
            if not _is_word(word):
                raise ValueError(f"{name}: {where} sent the key {str(word)[:40]!r}, which is not one word of the "
                                 f"basic tokeniser of at most {MAX_WORD_CHARS} characters; send the output of "
                                 "site_word_counts")
            if not (isinstance(count, int) and not isinstance(count, bool) and min_count <= count <= MAX_COUNT):
                raise ValueError(f"{name}: {where} sent the count {count!r} for {word!r}; counts must be integers in "
                                 f"[min_count={min_count}, {MAX_COUNT}] (rarer words must not leave a site)")
        site_total = sum(counts.values())
        if site_total:
            total.update({w: max(1, round(c * SITE_MASS / site_total)) for w, c in counts.items()})
        sites.update(counts.keys())
    kept = sorted((w for w in total if sites[w] >= min_sites), key=lambda w: (-total[w], w))
    return {w: total[w] for w in kept[:max_words]}


def build_wordpiece_vocab(word_counts: Mapping[str, int], vocab_size: int) -> list[str]:
    """A BERT-format vocabulary of exactly ``vocab_size`` tokens, deterministic for given counts:

    1. :data:`SPECIAL_TOKENS` (ids 0..4);
    2. every character of the words (code-point order), then each as a ``##`` continuation: greedy longest-match
       WordPiece can then spell any word of these characters (an unseen word becomes its characters, not [UNK]);
    3. the whole words of two or more characters, most frequent first (ties alphabetical);
    4. if room is left: word-start pieces and ``##`` suffix pieces of 2..8 characters of the words, scored by the
       summed counts of the words having them (ties alphabetical);
    5. ``[unused0]``, ``[unused1]`` ... up to ``vocab_size``.

    The characters take at most :data:`MAX_CHAR_SHARE` of ``vocab_size`` (plain and ``##``), or the characters
    that each hold :data:`CORE_CHAR_SHARE` of the counts if they are more, and never more than fits: beyond it the
    characters of the smallest summed counts are left out, with every word that contains one, so words made up to
    spread the character set cannot make the build fail or fill the vocabulary.  Raises a ValueError only when
    ``vocab_size`` cannot hold the special tokens and one character."""
    name = "build_wordpiece_vocab"
    require(isinstance(word_counts, Mapping), name, "word_counts", type(word_counts).__name__,
            "pass the {word: count} dict of merge_word_counts")
    for word, count in word_counts.items():
        require(_is_word(word), name, "word_counts", str(word)[:40],
                "every key must be one word of basic_words (merge_word_counts output)")
        require(isinstance(count, int) and not isinstance(count, bool) and count > 0, name, f"word_counts[{word!r}]",
                count, "counts must be positive integers")
    require_int(name, "vocab_size", vocab_size, len(SPECIAL_TOKENS) + 2,
                f"the {len(SPECIAL_TOKENS)} special tokens and at least one character (plain and ##) need "
                f"{len(SPECIAL_TOKENS) + 2} entries")
    char_score: Counter[str] = Counter()
    for w, c in word_counts.items():
        for ch in set(w):
            char_score[ch] += c
    mass = sum(char_score.values())
    core = sum(1 for v in char_score.values() if v >= CORE_CHAR_SHARE * mass)  # at most 1 / CORE_CHAR_SHARE of them
    room = min(max(1, int(MAX_CHAR_SHARE * vocab_size) // 2, core), (vocab_size - len(SPECIAL_TOKENS)) // 2)
    chars = sorted(sorted(char_score, key=lambda ch: (-char_score[ch], ch))[:room])
    allowed = set(chars)
    word_counts = {w: c for w, c in word_counts.items() if set(w) <= allowed}
    vocab = list(SPECIAL_TOKENS) + chars + ["##" + c for c in chars]
    seen = set(vocab)
    words = sorted((w for w in word_counts if len(w) > 1), key=lambda w: (-word_counts[w], w))
    for w in words[: vocab_size - len(vocab)]:
        vocab.append(w)
        seen.add(w)
    if len(vocab) < vocab_size:
        scores: Counter[str] = Counter()
        for w, c in word_counts.items():
            for j in range(2, min(len(w), _MAX_PIECE_CHARS + 1)):  # word starts, shorter than the word
                scores[w[:j]] += c
            for i in range(max(1, len(w) - _MAX_PIECE_CHARS), len(w) - 1):  # suffixes of >= 2 characters
                scores["##" + w[i:]] += c
        pieces = sorted((p for p in scores if p not in seen), key=lambda p: (-scores[p], p))
        vocab += pieces[: vocab_size - len(vocab)]
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    return vocab


def _check_vocab(vocab: object, what: str) -> None:
    require(isinstance(vocab, (list, tuple)) and len(vocab) >= len(SPECIAL_TOKENS), what, "vocab",
            type(vocab).__name__ if not isinstance(vocab, (list, tuple)) else f"{len(vocab)} tokens",
            "pass a list of token strings holding at least the special tokens (build_wordpiece_vocab)")
    for i, token in enumerate(vocab):
        require(isinstance(token, str) and token != "" and not any(c.isspace() for c in token), what, f"vocab[{i}]",
                token, "tokens are non-empty strings without whitespace")
    dup = [t for t, n in Counter(vocab).items() if n > 1]
    require(not dup, what, "vocab", f"duplicates {dup[:4]}", "every token may appear once")
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    require(not missing, what, "vocab", f"missing {missing}", f"the vocabulary must contain {list(SPECIAL_TOKENS)}")


def make_tokenizer(vocab: Sequence[str] | None = None, path: str = ""):
    """A ``transformers.PreTrainedTokenizerFast``: from ``vocab`` (a token list, id = position) or ``path``, a
    vocab.txt file (:func:`load_vocab`) or a local Hugging Face tokenizer folder (``AutoTokenizer.from_pretrained``
    with ``local_files_only=True``: nothing is downloaded).  From a vocabulary: BERT's normaliser (lower case, accents
    stripped), BERT's pre-tokeniser, greedy longest-match WordPiece (``[UNK]`` for a word with a character outside the
    vocabulary), ``[CLS] text [SEP]`` (pairs ``[CLS] a [SEP] b [SEP]``), padding with ``[PAD]``."""
    name = "make_tokenizer"
    require(isinstance(path, str), name, "path", path, "pass a path string or ''")
    require((vocab is None) != (path == ""), name, "vocab/path", (None if vocab is None else "a list", path),
            "pass exactly one of vocab (a token list) and path (a vocab.txt file or a tokenizer folder)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # slow import: only where a tokenizer is made

    if path:
        if os.path.isdir(path):
            try:
                return AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError) as e:
                raise ValueError(f"{name}: path={path!r} is not a loadable tokenizer folder ({e}); pass a folder "
                                 "written by save_pretrained or a vocab.txt file") from None
        require(os.path.isfile(path), name, "path", path, "pass an existing vocab.txt file or tokenizer folder")
        vocab = load_vocab(path)
    _check_vocab(vocab, name)
    ids = {token: i for i, token in enumerate(vocab)}
    tok = Tokenizer(WordPiece(vocab=ids, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = ("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[cls, sep])
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", padding_side="right",
                                   truncation_side="right")


def tokenize(tokenizer, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both LongTensors ``[len(texts), max_length]``: ``[CLS] ... [SEP]``, truncated
    (the final ``[SEP]`` kept) and right-padded with ``[PAD]`` (mask 0) to ``max_length``."""
    name = "tokenize"
    require(isinstance(texts, (list, tuple)) and len(texts) > 0 and all(isinstance(t, str) for t in texts), name,
            "texts", type(texts).__name__, "pass a non-empty list of strings")
    require_int(name, "max_length", max_length, 2, "pass at least 2 ([CLS] and [SEP]); at most the text encoder's "
                "max_position (BERT: 512)")
    enc = tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt",
                    return_token_type_ids=False)
    return enc["input_ids"].long(), enc["attention_mask"].long()


def save_vocab(vocab: Sequence[str], path: str | os.PathLike) -> None:
    """Write ``vocab`` as a BERT vocab.txt: one token per line, UTF-8, line i = id i."""
    _check_vocab(vocab, "save_vocab")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(vocab) + "\n")


def load_vocab(path: str | os.PathLike) -> list[str]:
    """The tokens of a vocab.txt file (one per line, line i = id i)."""
    if not os.path.isfile(path):
        raise ValueError(f"load_vocab: {path} does not exist; pass a vocab.txt written by save_vocab")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line.rstrip("\r") for line in lines]
    for i, token in enumerate(lines):
        if token == "" or any(c.isspace() for c in token):
            raise ValueError(f"load_vocab: {path} line {i + 1} holds {token!r}; a vocab.txt has one token (no "
                             "spaces) per line")
    try:
        _check_vocab(lines, "load_vocab")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return lines


__all__ = [
    "CLS_ID",
    "DEFAULT_MIN_COUNT",
    "MASK_ID",
    "MAX_MERGED_WORDS",
    "MAX_SITE_WORDS",
    "MAX_WORD_CHARS",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "basic_words",
    "build_wordpiece_vocab",
    "load_vocab",
    "make_tokenizer",
    "merge_word_counts",
    "save_vocab",
    "site_word_counts",
    "tokenize",
]
