"""The global head is rebuilt over the registered classes by name (known rows kept, new rows seeded)."""

import numpy as np

from fedssl.flare.surgical_persistor import rehead


def test_rows_follow_names_and_new_rows_are_seeded():
    w = np.array([[1, 1], [2, 2]], np.float32)
    b = np.array([1, 2], np.float32)
    nw, nb = rehead(w, b, ["A", "B"], ["B", "C", "A"], seed=0)
    np.testing.assert_array_equal(nw[0], [2, 2]) and np.testing.assert_array_equal(nw[2], [1, 1])
    np.testing.assert_array_equal(nb, [2, 0, 1])
    assert np.all(np.abs(nw[1]) <= 1 / np.sqrt(2)) and np.any(nw[1] != 0)
    again, _ = rehead(w, b, ["A", "B"], ["B", "C", "A"], seed=0)
    np.testing.assert_array_equal(nw, again)
    other, _ = rehead(w, b, ["A", "B"], ["B", "C", "A"], seed=1)
    assert not np.array_equal(nw[1], other[1])
