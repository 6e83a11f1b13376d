"""Mutation run over the fedssl package (issue 47): a declarative list of semantic mutants (:mod:`.mutants`), a runner
that applies each to a copy of the tree and runs its tests (:mod:`.run`), and a fast check of the list itself
(``test_mutants.py``)."""
