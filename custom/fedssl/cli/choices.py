"""The option choices that the verbs list, as plain constants: building the parser (``fedssl --help``, any verb's
``--help``) imports no data or experiment module, and through them no torch, MONAI or FLARE.

Each constant mirrors the one the verb hands its values to (named beside it); tests/unit/cli/test_cli_help.py
checks that they are equal, so a method added to a runner and not here fails there, not silently at the command
line."""

from __future__ import annotations

#: :data:`fedssl.data.images.SSLFL_DATASETS`
SSLFL_DATASETS: tuple[str, ...] = ("retina", "derm", "covidfl", "derm_mel")
#: ``sorted(fedssl.experiments.sslfl_tables.SPLIT_ALPHA)``: SSL-FL's Split-1 / 2 / 3
SSLFL_TABLE_SPLITS: tuple[int, ...] = (1, 2, 3)
#: the keys of :data:`fedssl.experiments.sslfl_tables.METHODS`
SSLFL_TABLE_METHODS: tuple[str, ...] = ("scratch", "fedmae", "fedbeit")
#: fedssl.experiments.sslfl_control.ARMS
SSLFL_CONTROL_ARMS: tuple[str, ...] = ("scratch", "fedmae", "mae_init")
#: :data:`fedssl.experiments.fedclf_tables.TABLES`
FEDCLF_TABLES: tuple[int, ...] = (1, 2)
#: the keys of :data:`fedssl.experiments.fedclf_tables.METHODS`
FEDCLF_METHODS: tuple[str, ...] = ("random", "local_cl", "fedrotation", "fedsimclr", "fedmoco", "fe", "fedclf")
#: :data:`fedssl.experiments.fedclf_tables.FRACTIONS`
FEDCLF_FRACTIONS: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8)
#: the keys of :data:`fedssl.experiments.fedmae_table3.METHODS`
TABLE3_METHODS: tuple[str, ...] = ("random", "local_cl", "fedrotation", "fedsimclr", "fedmoco", "fedclf",
                                   "vit_random", "fedmae")
#: :data:`fedssl.experiments.feddra_demo.VARIANTS`
FEDDRA_VARIANTS: tuple[str, ...] = ("fedavg", "no_two_stage", "no_anchor", "no_dro", "feddra", "decentralised",
                                    "centralised")
