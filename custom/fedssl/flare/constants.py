"""Names shared by the client executors and the server workflows / filters: task names, meta and header keys.

Both sides import them from here (never a client from a server workflow module), so a site needs none of the
server's code to speak the protocol.  Plain strings and tuples only: no FLARE import.
"""

from __future__ import annotations

# ---------------------------------------------------------------- FCLOpt / FedBYOL (fclopt_controller, byol_executor)
#: the BYOL variants of the FCLOptController (``mode``)
MODES = ("fedbyol", "fclopt", "ptnu", "ptnu_dp")
#: task-data meta keys: the run's mode, the DP target distance, whether the site uploads its target network
MODE_KEY = "byol_mode"
DISTANCE_KEY = "target_distance"
UPLOAD_TARGET_KEY = "upload_target"
#: result meta key of the DP ``report_distance`` task: the site's proxy distance d_pc
PROXY_KEY = "d_pc"
#: the DP task that precedes ``train`` in a PTNU-DP round
DISTANCE_TASK = "report_distance"

# --------------------------------------------------------- federated k-means tokenizer (federated_kmeans, mim_executor)
KMEANS_INIT = "kmeans_init"
KMEANS_STEP = "kmeans_step"
SET_TOKENIZER = "set_tokenizer"
#: meta keys of the task data
K_KEY, IMAGES_KEY, LOCAL_ITERS_KEY, SEED_KEY, ITER_KEY, DESCRIPTION_KEY = (
    "vocab_size", "images_per_site", "local_iters", "seed", "kmeans_iter", "tokenizer")
#: result meta key of a site that uses a local tokenizer (its description, "local: <path>")
LOCAL_TOKENIZER_KEY = "local_tokenizer"
INIT_KEY = "init"
#: task meta: the fewest patch vectors any statistic a site sends may cover; result meta: the site's sample size
MIN_CLUSTER_KEY, VECTORS_KEY = "min_cluster_size", "n_vectors"

# ---------------------------------------------------- surgical aggregation (surgical_registration, multilabel_executor)
METHODS = ("surgical", "vanilla", "partial_loss", "personalised", "individual")
BACKBONES = ("fedavg", "fedbn", "fedbn_plus")
DECLARE_TASK = "declare_classes"
#: meta keys of the exchange
METHOD_KEY, BACKBONE_KEY = "method", "backbone"
CLASSES_KEY, GLOBAL_CLASSES_KEY = "classes", "global_classes"
#: task / result header carrying the backbone strategy (backbone_exclusion, multilabel_executor)
BACKBONE_HEADER = "fedssl_backbone_strategy"

# --------------------------------------- FCL feature banks (feature_bank_collector, feature_bank_shuttle, fcl_executor)
REMOTE_FEATURES = "remote_bank_features"
REMOTE_PARTITIONS = "remote_bank_partitions"
#: result meta keys of an FCL site's own bank (fcl_executor -> feature_bank_collector)
BANK_FEATURES = "bank_features"
BANK_PARTITIONS = "bank_partitions"

# ---------------------------------------------------------------- filters and the run summary
#: DXO meta key listing the tensors a PartialModelExclusion kept on the site
EXCLUDED_META = "excluded_keys"
#: result meta key under which a site sends a dict of records for the summary (run_summary)
SITE_RECORD_META = "summary_record"

# ---------------------------------------------------------------- server-side round bookkeeping (never sent to a site)
#: sticky FL-context property a workflow sets before a round's broadcast: ``{"round": r, "optional": bool}``, whether
#: the contributions of round r carry the aggregator's ``optional_prefixes`` keys (FCLOptController: the target net)
ROUND_PLAN_PROP = "fedssl.round_plan"
#: FL-context property the aggregators set for AFTER_AGGREGATION listeners (RunSummary): ``{"sites": [...],
#: "losses": {site: loss}}``; memory only, it names the sites and is never persisted
ROUND_STATS_PROP = "fedssl.round_stats"
#: DXO meta of an aggregate that stays on the server (MergingShareableGenerator strips it from the global model)
AGGREGATED_SITES = "aggregated_sites"
COLLECTED = "collected"
#: FL-context property an aggregator sets when it refuses a contribution: ``{"site": name, "reason": text}``
REFUSAL_PROP = "fedssl.refusal"
#: sticky FL-context property the server's persistor sets when it builds the initial global model: which initial
#: weights the run starts from, ``{"init": "imagenet" | "random" | "checkpoint", "path": str, "sha256": str}``
#: (path and digest empty for random init); RunSummary writes it to summary.json as ``init``
INIT_PROP = "fedssl.init"

# ------------------------------------------------------- FedDRA (feddra_controller, dro_weight_filter, feddra_executor)
#: the stage-1 task of a communication turn (alignment modules and projections only); stage 2 is "train"
ALIGN_TASK = "train_alignment"
#: task meta: the stage a task runs ("align", "full_model", "fedavg"), whether DRO weighting is on, and, set per site
#: by the DROWeightFilter only, that site's own weight lambda_i and the number of sites N
STAGE_KEY, DRO_ON_KEY, DRO_WEIGHT_KEY, DRO_SITES_KEY = "feddra_stage", "dro_weighting", "dro_weight", "dro_sites"
#: result meta of a stage-2 / FedAvg task: the site's held-out contrastive loss v_i
DRO_LOSS_KEY = "dro_loss"
#: the vocabulary exchange before round 0: each site's frequent-word counts, then the built vocabulary
WORD_COUNTS_TASK, SET_VOCAB_TASK = "word_counts", "set_vocab"
WORD_COUNTS_KEY, VOCAB_KEY, MIN_COUNT_KEY = "word_counts", "vocab", "min_count"
#: sticky private FL-context property (server only): ``{"round": r, "weights": {site: lambda}}`` for the filter
DRO_WEIGHTS_PROP = "fedssl.dro_weights"
