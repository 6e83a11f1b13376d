"""Instance discrimination (fedssl.core.discrimination): hand-computed InfoNCE, chance and top-1."""

import math

import pytest
import torch

from fedssl.core.discrimination import instance_discrimination, knn_accuracy

torch.set_num_threads(1)


def test_orthogonal_views_by_hand():
    """z1 = z2 = e_1, e_2, e_3 (tau 1): each row's positive logit is 1, its two negatives 0, so
    loss = log(e + 2) - 1, chance = log 3, every positive on top."""
    eye = torch.eye(3)
    d = instance_discrimination(eye, eye, tau=1.0)
    assert d.loss == pytest.approx(math.log(math.e + 2) - 1) and d.chance == pytest.approx(math.log(3))
    assert (d.top1, d.n) == (1.0, 3)


def test_groups_remove_same_group_rows_from_the_negatives():
    """groups (0, 0, 1): rows 0 and 1 keep only row 2 as a negative, row 2 keeps both; tau 0.5 doubles the logits."""
    eye = torch.eye(3)
    d = instance_discrimination(eye * 4, eye, tau=0.5, groups=torch.tensor([0, 0, 1]))  # rows are normalised first
    one, two = math.log(math.exp(2) + 1) - 2, math.log(math.exp(2) + 2) - 2
    assert d.loss == pytest.approx((2 * one + two) / 3)
    assert d.chance == pytest.approx((2 * math.log(2) + math.log(3)) / 3) and d.n == 3


def test_the_positive_is_the_other_view_of_the_same_row():
    """Views swapped between rows 0 and 1: their positives score 0 and a negative scores 1 (tau 1); row 2 is fine."""
    eye = torch.eye(3)
    d = instance_discrimination(eye, eye[[1, 0, 2]], tau=1.0)
    wrong = math.log(math.e + 2) - 0.0
    assert d.loss == pytest.approx((2 * wrong + math.log(math.e + 2) - 1) / 3)
    assert d.top1 == pytest.approx(1 / 3)


def test_collapsed_features_sit_at_chance_and_never_on_top():
    z = torch.ones(5, 4)
    d = instance_discrimination(z, z.clone(), tau=0.1)
    assert d.loss == pytest.approx(math.log(5)) and d.chance == pytest.approx(math.log(5)) and d.top1 == 0.0


def test_rows_with_different_numbers_of_negatives_average_their_own_chance():
    """groups (0, 1, 1, 1) over e_1..e_4 (tau 1): row 0 has 3 negatives, rows 1-3 have 1 each (row 0)."""
    eye = torch.eye(4)
    d = instance_discrimination(eye, eye, tau=1.0, groups=torch.tensor([0, 1, 1, 1]))
    assert d.n == 4 and d.chance == pytest.approx((math.log(4) + 3 * math.log(2)) / 4)
    assert d.loss == pytest.approx((math.log(math.e + 3) - 1 + 3 * (math.log(math.e + 1) - 1)) / 4)


@pytest.mark.parametrize("args, match", [
    ((torch.eye(3), torch.eye(2)), r"two views \[M, D\] of the same M >= 2 inputs, got shapes \(3, 3\) and \(2, 2\)"),
    ((torch.eye(3), torch.eye(3), 0.0), r"tau=0.0: must be a positive number"),
    ((torch.eye(3), torch.eye(3), 0.1, torch.tensor([0, 1])), r"groups has 2 entries for 3 inputs"),
    ((torch.eye(3), torch.eye(3), 0.1, torch.tensor([7, 7, 7])), r"no negatives to discriminate against"),
])
def test_bad_input_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        instance_discrimination(*args)


def test_knn_accuracy_by_hand_with_neighbours_from_other_groups_only():
    """Rows on two directions: label 0 near e_1, label 1 near e_2; groups pair each row with a twin of the other
    label, so without the group rule a row's nearest neighbour would often be its twin."""
    z = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    labels = torch.tensor([0, 0, 1, 1])
    assert knn_accuracy(z, labels, torch.tensor([0, 1, 2, 3]), k=1) == 1.0
    # groups {0, 1} and {2, 3}: each row's only neighbours are the other label's rows -> every vote wrong
    assert knn_accuracy(z, labels, torch.tensor([0, 0, 1, 1]), k=1) == 0.0
    # groups {0, 2} and {1, 3}: row 0 sees rows 1, 3 (nearest 1: label 0, right), and so on
    assert knn_accuracy(z, labels, torch.tensor([0, 1, 0, 1]), k=1) == 1.0


def test_knn_vote_ties_go_to_the_smaller_label():
    """Row 0 (label 1) has neighbours of labels 0 and 1 at k = 2: a tie, label 0 wins, so row 0 is a miss."""
    z = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, -0.1], [0.0, 1.0]])
    labels = torch.tensor([1, 0, 1, 0])
    groups = torch.tensor([0, 1, 2, 3])
    # row 0: neighbours rows 1, 2 (labels 0, 1) -> tie -> 0, wrong; row 1: rows 0, 2 (1, 1) -> 1, wrong;
    # row 2: rows 0, 1 (1, 0) -> 0, wrong; row 3: rows 1, 0 (0, 1) -> tie -> 0, right
    assert knn_accuracy(z, labels, groups, k=2) == pytest.approx(0.25)


@pytest.mark.parametrize("args, match", [
    ((torch.eye(3), torch.tensor([0, 1]), torch.arange(3)), r"one label and one group per row"),
    ((torch.eye(3), torch.arange(3), torch.arange(3), 0), r"k=0: must be a positive integer"),
    ((torch.eye(3), torch.arange(3), torch.tensor([0, 0, 1]), 2),
     r"k=2 neighbours from other groups are not available"),
    ((torch.eye(3), torch.tensor([0, -1, 1]), torch.arange(3), 1), r"non-negative class indices"),
])
def test_knn_bad_input_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        knn_accuracy(*args)
