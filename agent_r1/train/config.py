"""The training config: a Hydra composition of ``configs/`` checked against typed slices.

Each slice is a dataclass that validates itself (``__post_init__``); ``load_config`` composes the
YAML groups and command-line overrides, merges them onto the typed schema (an unknown key fails
there, naming it) and builds the objects (a bad value fails there, naming the slice). Nothing
starts before the whole config is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agent_r1.agent.episode import EpisodeSettings
from agent_r1.algos.advantages import AdvantageConfig
from agent_r1.algos.losses import LossConfig
from agent_r1.engine_spec import ENGINES
from agent_r1.engines.sglang import SGLangConfig
from agent_r1.engines.vllm import VLLMConfig
from agent_r1.errors import UsageError
from agent_r1.learner.optim import OptimConfig
from agent_r1.rollout.served import RESERVED

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# keys that moved to another slice: a config naming the old key is told the new one
MOVED = {
    f"rollout.{k}": f"episode.{k}"
    for k in ("max_steps", "max_obs_tokens", "max_action_tokens", "temperature", "top_p")
}


class ConfigError(UsageError, ValueError):
    """A config key or value is wrong; the message names it."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")


@dataclass
class TinyModelConfig:
    """How to build the model when ``model.path`` does not exist yet (quickstart)."""

    at: str = "artifacts/tiny-qwen3"  # the only folder it is built in: another missing path is an error
    recipe: str = "arithmetic_tool"  # whose text trains the tokenizer
    arch: str = "qwen3"
    vocab_size: int = 1024
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0
    chat_format: str = "chatml"  # chatml (Qwen, Hermes tool calls) | llama3 | harmony (gpt-oss)
    split_digits: bool = False  # one token per digit (as Qwen2 / Llama 3 tokenize numbers)

    def __post_init__(self) -> None:
        _check(
            self.chat_format in ("chatml", "llama3", "harmony"),
            "model.build.chat_format",
            f"chatml, llama3 or harmony, got {self.chat_format!r}",
        )


@dataclass
class ModelConfig:
    path: str = "artifacts/tiny-qwen3"  # HF folder (config.json, safetensors, tokenizer)
    build: TinyModelConfig | None = None  # build a tiny random model at ``path`` when missing
    dtype: str = "float32"
    precision: str = "default"  # default | fp8 (Transformer Engine, GPU)
    fp8_recipe: str = "delayed"
    max_len: int = 2048  # rollout server context length
    train_vision: bool = False  # a vision-language model's vision tower trains with the policy

    def __post_init__(self) -> None:  # dtype, precision, fp8_recipe: BridgeConfig checks those
        _check(self.max_len >= 16, "model.max_len", f"must be >= 16, got {self.max_len}")


@dataclass
class ParallelConfig:
    learner_ranks: int = 1  # = tp * pp * dp
    tp: int = 1
    pp: int = 1
    # expert parallel (mixture-of-experts models): the experts spread over ep ranks of the
    # tp * dp ranks of a stage, each expert whole (expert TP 1)
    ep: int = 1
    # sequence parallel (with tp > 1): norms, dropout and the residual stream hold 1/tp of the
    # tokens each, gathered for the tensor-parallel matmuls; Megatron-Core needs it for MoE at tp > 1
    sp: bool = False
    # virtual pipeline stages per pipeline rank (Megatron's interleaved schedule, pp > 1): each rank
    # holds vpp non-adjacent slices of the layers, which shrinks the pipeline bubble vpp times
    vpp: int = 1
    # context parallel: each sequence of a micro-batch split over cp ranks (long contexts; the
    # ranks of a data-parallel replica share its records)
    cp: int = 1
    backend: str = "gloo"  # gloo (CPU) | nccl (GPU)

    def __post_init__(self) -> None:
        _check(self.tp >= 1 and self.pp >= 1, "parallel.tp/pp", f"must be >= 1, got {self.tp}, {self.pp}")
        _check(self.cp >= 1, "parallel.cp", f"must be >= 1, got {self.cp}")
        model = self.tp * self.pp * self.cp
        _check(
            self.learner_ranks >= 1 and self.learner_ranks % model == 0,
            "parallel.learner_ranks",
            f"must be a multiple of tp*pp*cp = {model}, got {self.learner_ranks}",
        )
        stage = self.tp * self.cp * self.dp
        _check(
            self.ep >= 1 and stage % self.ep == 0,
            "parallel.ep",
            f"must divide the tp * cp * dp = {stage} ranks of a pipeline stage, got {self.ep}",
        )
        _check(
            not self.sp or self.tp > 1,
            "parallel.sp",
            "sequence parallelism splits tokens over the tensor-parallel ranks: it needs parallel.tp > 1",
        )
        _check(
            self.vpp >= 1 and (self.vpp == 1 or self.pp > 1),
            "parallel.vpp",
            f"must be >= 1, and > 1 only with parallel.pp > 1 (virtual stages of a pipeline), got {self.vpp}",
        )
        _check(self.backend in ("gloo", "nccl"), "parallel.backend", f"gloo or nccl, got {self.backend!r}")

    def initialize(self) -> None:
        """Megatron-Core's model-parallel groups for this layout (torch.distributed is up)."""
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(
            self.tp,
            self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=1,
        )

    @property
    def dp(self) -> int:
        return self.learner_ranks // (self.tp * self.pp * self.cp)


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # what the run is called in summaries
    advantage: str = "grpo"  # estimator (agent_r1.algos.advantages.ADVANTAGES)
    loss: str = "ppo"  # policy loss (agent_r1.algos.losses.POLICY_LOSSES)
    estimator: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy: LossConfig = field(default_factory=LossConfig)
    process_coef: float = 1.0  # weight of process rewards next to the outcome reward
    epochs: int = 1  # passes over each iteration's records
    mini_batches: int = 1  # optimizer steps per epoch
    critic: bool = False  # train a value model (step GAE / token GAE)
    reward_scaling: bool = False  # PSPO: rewards / running std of discounted step returns
    critic_lr: float = 1e-4
    reference: bool = False  # keep a frozen reference policy (needed when policy.kl_coef > 0)
    teacher: str | None = None  # OPD: HF folder of the teacher, served by its own rollout server

    def __post_init__(self) -> None:
        from agent_r1.algos.advantages import ADVANTAGES
        from agent_r1.algos.losses import POLICY_LOSSES

        _check(
            self.advantage in ADVANTAGES,
            "algorithm.advantage",
            f"one of {sorted(ADVANTAGES)}, got {self.advantage!r}",
        )
        _check(
            self.loss in POLICY_LOSSES, "algorithm.loss", f"one of {sorted(POLICY_LOSSES)}, got {self.loss!r}"
        )
        _check(self.epochs >= 1 and self.mini_batches >= 1, "algorithm.epochs/mini_batches", "must be >= 1")
        needs = ADVANTAGES.get(self.advantage).needs
        _check(
            not ({"value", "token_values"} & set(needs)) or self.critic,
            "algorithm.critic",
            f"estimator {self.advantage!r} needs a critic (set algorithm.critic=true)",
        )
        _check(
            ("teacher_logprobs" not in needs and self.loss != "opd") or bool(self.teacher),
            "algorithm.teacher",
            f"{self.advantage!r}/{self.loss!r} needs a teacher model (algorithm.teacher=PATH)",
        )
        _check(
            self.policy.kl_coef == 0 or self.reference,
            "algorithm.reference",
            "policy.kl_coef > 0 needs the frozen reference (algorithm.reference=true)",
        )


DECOUPLED_TIS_CAP = 2.0  # the behaviour weight's cap when async rollouts turn it on


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # an entry of engine_spec.ENGINES: embedded | sglang | vllm | external (urls)
    servers: int = 1  # rollout servers started by the launcher
    workers: int = 1  # rollout worker processes (agent flows, environments, tools)
    urls: list[str] = field(default_factory=list)  # engine=external: running servers
    group_size: int = 8  # samples per prompt (n)
    prompts_per_iteration: int = 16
    max_concurrency: int = 64  # episodes in flight per worker
    # sync | async (generate v+1 while training v) | stream (every admitted task in flight at once,
    # each group committed as it finishes: the learner waits for its batch's groups, not a share)
    mode: str = "sync"
    max_staleness: int = 1  # async, stream: policy versions a record may lag behind the learner
    # a weight push lets every in-flight action finish on the version it started with (step-atomic;
    # the next step of each episode runs on the new one); > 0: an action already this many tokens
    # long is interrupted instead and continued on the new weights (its tokens' versions recorded)
    interrupt_tokens: int = 0
    weight_sync: str = "distributed"  # distributed (bucketed broadcast) | disk (safetensors)
    bucket_mb: int = 256
    request_timeout_s: float = 300.0
    ready_timeout_s: float = 300.0
    server_cpus: int = 1  # torch threads per embedded server
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # engine=sglang: launch flags
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # engine=vllm: launch flags
    router: bool = False  # the real sglang-router in front of the servers (workers talk to it)
    router_policy: str = "cache_aware"  # random | round_robin | cache_aware | power_of_two
    # other models served beside the policy, each by a role of its name, e.g. {selector: HF_DIR}
    # (paper_search's LLM judge) or {summarizer: HF_DIR}; the OPD teacher is algorithm.teacher
    helpers: dict[str, str] = field(default_factory=dict)
    # the recipe's environment as a service (recipes/<name>/server.py, e.g. webshop): one
    # env_server role every worker's environments talk to, restarted like the other roles
    env_server: bool = False

    def __post_init__(self) -> None:
        _check(self.engine in ENGINES, "rollout.engine", f"one of {', '.join(ENGINES)}, got {self.engine!r}")
        spec = ENGINES[self.engine]
        _check(
            spec.router or not self.router,
            "rollout.router",
            f"the sglang-router routes SGLang's API; with engine={self.engine} the workers spread requests "
            "themselves",
        )
        _check(
            spec.disk_sync or self.weight_sync == "distributed",
            "rollout.weight_sync",
            f"engine={self.engine} takes weights only through its weight-transfer API (a server without "
            "those routes reloads from the run's exported weights by itself); leave weight_sync=distributed",
        )
        _check(
            spec.serving != "none" or bool(self.urls),
            "rollout.urls",
            f"engine={self.engine} needs server urls (the run starts none)",
        )
        _check(self.servers >= 1 and self.workers >= 1, "rollout.servers/workers", "must be >= 1")
        _check(self.group_size >= 1, "rollout.group_size", f"must be >= 1, got {self.group_size}")
        _check(self.prompts_per_iteration >= 1, "rollout.prompts_per_iteration", "must be >= 1")
        _check(
            self.mode in ("sync", "async", "stream"),
            "rollout.mode",
            f"sync, async or stream, got {self.mode!r}",
        )
        _check(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
        _check(self.interrupt_tokens >= 0, "rollout.interrupt_tokens", "must be >= 0 (0: never interrupt)")
        _check(
            self.weight_sync in ("distributed", "disk"),
            "rollout.weight_sync",
            f"distributed or disk, got {self.weight_sync!r}",
        )
        _check(
            self.router_policy in ("random", "round_robin", "cache_aware", "power_of_two"),
            "rollout.router_policy",
            f"random, round_robin, cache_aware or power_of_two, got {self.router_policy!r}",
        )
        for k in ("max_concurrency", "bucket_mb"):
            _check(getattr(self, k) >= 1, f"rollout.{k}", f"must be >= 1, got {getattr(self, k)}")
        for name, path in self.helpers.items():
            _check(
                name.isidentifier() and name not in (*RESERVED, "teacher"),
                f"rollout.helpers.{name}",
                f"a helper model needs a name of its own (not {', '.join(RESERVED)}; the OPD "
                "teacher is algorithm.teacher)",
            )
            _check(bool(path), f"rollout.helpers.{name}", "needs the HF folder of the model")


@dataclass
class DataConfig:
    """Rows from parquet files of data rows (``agent-r1 data`` writes them) instead of the
    recipe's generator or loader; the recipe still provides the agents, tools and rewards."""

    train_files: list[str] = field(default_factory=list)
    test_files: list[str] = field(default_factory=list)
    shared_file_ok: bool = False  # allow train and test to read the same file (a warning then)


@dataclass
class RetrievalConfig:
    """The search tools' index. ``index`` is a folder (``agent-r1 index build``); when it is missing
    and ``build`` is true the launcher builds it from the recipe's own passages (the offline world,
    or the dataset files' passages). ``serve``: one retriever role shared by all workers (placed
    on the rollout nodes under Slurm); false: every worker loads the index itself."""

    index: str | None = None
    build: bool = True
    serve: bool = True
    mode: str = "sparse"  # sparse (bm25s) | dense (MiniLM) | hybrid
    dense: bool = False  # also build the dense index (needed by dense / hybrid)

    def __post_init__(self) -> None:
        _check(
            self.mode in ("sparse", "dense", "hybrid"),
            "retrieval.mode",
            f"sparse, dense or hybrid, got {self.mode!r}",
        )
        _check(self.mode == "sparse" or self.dense, "retrieval.dense", f"mode={self.mode} needs dense=true")


@dataclass
class RecipeConfig:
    name: str = "arithmetic_tool"
    train_size: int = 512
    test_size: int = 64
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # extra build_rows arguments (e.g. difficulty)
    train_path: str | None = None  # the public dataset's own train file (recipes that read one)
    test_path: str | None = None  # ... and its held-out file
    env: dict[str, Any] = field(default_factory=dict)  # environment options for every row (the row's own win)

    def __post_init__(self) -> None:
        from recipes import RECIPES

        _check(self.name in RECIPES, "recipe.name", f"one of {list(RECIPES)}, got {self.name!r}")
        _check(self.train_size >= 1 and self.test_size >= 1, "recipe.train_size/test_size", "must be >= 1")


@dataclass
class SFTConfig:
    """Warm start: supervised steps on the recipe's demonstration trajectories before RL."""

    steps: int = 0  # 0 = no warm start
    demos: int = 512
    batch_trajectories: int = 16
    lr: float = 1e-3
    min_lr: float | None = None  # cosine decay to this over the steps (None: constant after warmup)
    warmup_steps: int = 20
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # recipe.demonstrations arguments

    def __post_init__(self) -> None:
        _check(
            self.steps >= 0 and self.demos >= 1 and self.batch_trajectories >= 1,
            "sft",
            "steps >= 0, demos and batch_trajectories >= 1",
        )
        _check(self.lr > 0, "sft.lr", f"must be > 0, got {self.lr}")


@dataclass
class ClusterConfig:
    """Where roles run. ``local`` = processes on this machine; ``slurm`` = an sbatch het job."""

    launcher: str = "local"  # local | slurm
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    learner_nodes: int = 1
    rollout_nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: str | None = None
    colocated: bool = False  # one component for all roles
    container_image: str | None = None  # enroot/pyxis image (--container-image)
    container_mounts: list[str] = field(default_factory=list)
    apptainer_image: str | None = None
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load, venv)
    network_interface: str | None = None  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    requeue: bool = True
    signal_seconds: int = 300  # warning signal before the time limit (checkpoint and exit)
    extra_sbatch: list[str] = field(default_factory=list)
    python: str | None = None  # interpreter on the nodes (default: the one running `agent-r1 launch`)
    gpu_mem_gb: float = 80.0  # memory per GPU (H100 80, H200 141): what `agent-r1 plan` fits against
    # the local launcher: the CPUs each kind of role may run on, e.g. {learner: [0], server: [1],
    # worker: [1]} (roles on disjoint cores, as a cluster has them); a kind not named runs anywhere
    local_cpus: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            self.launcher in ("local", "slurm"), "cluster.launcher", f"local or slurm, got {self.launcher!r}"
        )
        _check(
            self.learner_nodes >= 1 and self.rollout_nodes >= 0,
            "cluster.learner_nodes/rollout_nodes",
            "learner_nodes >= 1, rollout_nodes >= 0",
        )
        _check(
            self.gpus_per_node >= 0 and self.cpus_per_task >= 1,
            "cluster.gpus_per_node/cpus_per_task",
            "must be >= 0 / >= 1",
        )
        _check(self.gpu_mem_gb > 0, "cluster.gpu_mem_gb", f"must be > 0, got {self.gpu_mem_gb}")
        for kind, cpus in self.local_cpus.items():
            _check(
                bool(cpus) and all(isinstance(c, int) and c >= 0 for c in cpus),
                f"cluster.local_cpus.{kind}",
                f"a non-empty list of CPU numbers, got {cpus!r}",
            )
        _check(
            not (self.container_image and self.apptainer_image),
            "cluster.container_image",
            "choose enroot/pyxis or apptainer, not both",
        )


@dataclass
class TrainerConfig:
    iterations: int = 10
    seed: int = 0
    run_dir: str | None = None  # default runs/<name>
    name: str = "run"
    resume: str = "auto"  # auto | never | PATH of a checkpoint
    eval_every: int = 5  # iterations (0 = only at start and end)
    eval_temperature: float = 0.0  # greedy
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    sample_trajectories: int = 2  # logged to TensorBoard as text per iteration
    progress: bool = True
    timeout_s: float = 1800.0  # waiting on another role
    plot: bool = True  # PNG curve at the end
    # a wall-clock budget in seconds for the whole run (warm start included, over every launch);
    # 0 = none. The run ends, evaluated and checkpointed, after the iteration that leaves no room
    # for another one of the same length: runs of different algorithms compare at the same cost.
    max_wall_s: float = 0.0
    # the same config and seed give the same bits (records, weights, summary) whatever the load:
    # batch-invariant rollout servers, seeded sampling per request, fixed learner thread counts
    deterministic: bool = False

    def __post_init__(self) -> None:
        _check(self.iterations >= 0, "trainer.iterations", "must be >= 0")
        _check(
            self.eval_every >= 0 and self.checkpoint_every >= 0,
            "trainer.eval_every/checkpoint_every",
            "must be >= 0",
        )
        _check(
            self.resume in ("auto", "never") or Path(self.resume).exists(),
            "trainer.resume",
            f"auto, never or an existing checkpoint path, got {self.resume!r}",
        )
        _check(self.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
        _check(
            self.max_wall_s >= 0, "trainer.max_wall_s", f"must be >= 0 (0 = no budget), got {self.max_wall_s}"
        )


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    episode: EpisodeSettings = field(default_factory=EpisodeSettings)  # budgets and sampling
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        _check_numbers(self, "")
        bridge_config(self)  # the learner's own checks of model.dtype / precision / fp8_recipe, tp, pp
        pol, rc = self.algorithm.policy, self.rollout
        if pol.tis_cap is None and rc.mode != "sync" and rc.max_staleness > 0:
            # rollouts up to max_staleness versions old: the decoupled objective by default (the
            # clipped ratio to the learner's recomputed logprobs, times the truncated
            # proximal/behaviour weight); algorithm.policy.tis_cap=0 turns it off
            pol.tis_cap = DECOUPLED_TIS_CAP
        invariant = [n for n, e in ENGINES.items() if e.batch_invariant]
        _check(
            not self.trainer.deterministic or (rc.engine in invariant and rc.mode == "sync"),
            "trainer.deterministic",
            f"needs rollout.mode=sync (else when a push lands decides which policy samples) and an engine "
            f"whose answers do not depend on their batch ({', '.join(invariant)}); got {rc.mode}, {rc.engine}",
        )
        par = self.parallel
        _check(
            not self.trainer.deterministic or (par.pp == 1 and par.cp == 1),
            "trainer.deterministic",
            "takes the policy's logprob values from the engine's forward of the whole model on each "
            f"learner rank: it needs parallel.pp=1 and parallel.cp=1, got pp={par.pp} cp={par.cp}",
        )
        _check(
            not self.optim.share_prefix or par.cp == 1,
            "optim.share_prefix",
            f"packs branches of a shared prefix, which context parallelism's split does not take: needs "
            f"parallel.cp=1, got cp={par.cp}",
        )
        _check(
            self.cluster.launcher == "slurm" or self.parallel.backend == "gloo",
            "parallel.backend",
            "the local launcher runs on CPU: use gloo",
        )


def _check_numbers(node: Any, prefix: str) -> None:
    """Every float of every slice is finite (``optim.lr=inf`` is no learning rate) and every
    ``*timeout_s`` is > 0: checked once here, so no slice can forget it."""
    for f in fields(node):
        v, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(v):
            _check_numbers(v, key + ".")
        elif isinstance(v, float):
            _check(math.isfinite(v), key, f"must be a finite number, got {v}")
            if f.name.endswith("timeout_s"):
                _check(v > 0, key, f"must be > 0 seconds, got {v:g}")


def _compose(overrides: list[str], config_name: str = "train") -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))
    except HydraException as e:
        moved = [f"{k} moved to {v}" for k, v in MOVED.items() if f"'{k}'" in str(e)]
        raise ConfigError(f"config: {moved[0] if moved else e}") from None
    finally:
        GlobalHydra.instance().clear()


def _resolve_policy(plain: dict[str, Any]) -> None:
    """``algorithm.policy`` from one source: the loss's registry settings fill what the config
    leaves unset, what the config sets wins, a clash with what the loss forces is an error."""
    from agent_r1.algos.losses import BASE_SETTINGS, POLICY_LOSSES, resolve_loss_settings

    alg = plain.get("algorithm")
    if not isinstance(alg, dict):
        alg = plain["algorithm"] = {}
    name = alg.get("loss", AlgorithmConfig.loss)
    if name in POLICY_LOSSES:  # an unknown loss is reported by AlgorithmConfig with the known ones
        given = {k: v for k, v in (alg.get("policy") or {}).items() if v is not None}  # None = unset
        alg["policy"] = {**BASE_SETTINGS, **resolve_loss_settings(name, given)}


def validate(raw: Any) -> TrainConfig:
    """Typed, validated config from a composed one; unknown keys and bad values name the key."""
    try:
        plain = OmegaConf.to_container(raw, resolve=True) if OmegaConf.is_config(raw) else raw
        _resolve_policy(plain)
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), plain)  # unknown keys fail here
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0]
        if key in MOVED:
            first = f"{key} moved to {MOVED[key]}"
        raise ConfigError(f"config key {key!r}: {first}" if key else f"config: {first}") from None
    except ValueError as e:
        raise ConfigError(f"config {e}") from None


def load_config(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> TrainConfig:
    return validate(_compose(list(overrides), config_name))


def from_yaml(path: str | Path) -> TrainConfig:
    """A run's saved config; a torn or hand-broken file is a ConfigError naming it."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
        raw = OmegaConf.create(text)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{path}: not a readable config{at}: {str(e).splitlines()[0]}") from None
    # a saved config has every section and ends with a newline: a torn one (a copy cut short) must
    # not be read as a shorter config with defaults in the rest
    missing = [f.name for f in fields(TrainConfig) if not OmegaConf.is_dict(raw) or f.name not in raw]
    if missing or not text.endswith("\n"):
        what = f"no {missing[0]} section" if missing else "it ends mid-line"
        raise ConfigError(f"{path}: incomplete ({what}): torn, or not written by agent-r1")
    try:
        return validate(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def bridge_config(cfg: TrainConfig):
    from megatron_bridge import BridgeConfig

    return BridgeConfig(
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        ep=cfg.parallel.ep,
        sp=cfg.parallel.sp,
        vpp=cfg.parallel.vpp,
        cp=cfg.parallel.cp,
        dtype=cfg.model.dtype,
        precision=cfg.model.precision,
        fp8_recipe=cfg.model.fp8_recipe,
    )
