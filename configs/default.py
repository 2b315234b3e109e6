"""Default job: a tiny Qwen3-style model learns column addition with fully asynchronous RL, on 2 CPU cores.

  python main.py --config=configs/default.py --workdir=/tmp/arealjax
  python main.py --config=configs/default.py --config.rl.max_staleness=0      # synchronous RL (the baseline)
  python main.py --config=configs/default.py:model=moe --workdir=/tmp/moe     # a Qwen3-MoE-style model instead
                                            # (8 experts, 2 per token: the dense model's active parameters)

SFT warm start on imperfect demonstrations (cached in the workdir), then PPO with GRPO advantages;
trainer and generator on disjoint (fake CPU) devices. See arealjax/train.py.

Expected on 2 CPU cores: about 5–6 minutes (the SFT warm start about 3 of them; a rerun on the same workdir reuses
it); held-out pass@1 0.52 ± 0.07 → 0.97 ± 0.05 over seeds 0–2 (benchmarks/results/learning.md).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from arealjax.sharding import DEFAULT_RULES
from arealjax.validate import parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, "configs/default.py", model="dense")
    if arg.model not in ("dense", "moe"):
        raise ValueError(f"configs/default.py: model={arg.model}: expected dense or moe")
    config = ml_collections.ConfigDict()
    config.seed = 0
    # Fake host devices when running on CPU (set before JAX starts; ignored by GPU/TPU backends).
    config.cpu_devices = 4
    # The CPU cores this process runs on ("0", "0-3,8"; empty = all it may use): XLA sizes its thread pools to them.
    config.cpus = ""
    # Multi-host (docs/pods.md): True on pods and SLURM, where jax.distributed.initialize() reads
    # the cluster; GPU hosts pass --coordinator/--num_processes/--process_id to main.py instead. A process silent
    # for heartbeat_seconds is taken for dead and every other process stops.
    config.distributed = False
    config.heartbeat_seconds = 60

    # A local Hugging Face directory (config.json, *.safetensors, tokenizer.json); empty = the random tiny model.
    config.model_path = ""
    config.tokenizer = ml_collections.ConfigDict()
    config.tokenizer.alphabet = "0123456789+-*=?.,:; abcdefghijklmnopqrstuvwxyz\n"
    config.model = ml_collections.ConfigDict()  # vocab size and special ids come from the tokenizer
    config.model.family = "qwen3"
    config.model.hidden_size = 128
    config.model.intermediate_size = 384
    config.model.num_layers = 3
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 32
    config.model.max_position_embeddings = 128
    config.model.rope_theta = 10000.0
    if arg.model == "moe":  # each layer's MLP is 8 experts of half its width, 2 per token (router replay in RL)
        config.model.update(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                            norm_topk_prob=True, router_aux_loss_coef=0.001)

    # Role -> devices and mesh axes. generator.devices = 0 shares the trainer's devices (colocated).
    config.mesh = ml_collections.ConfigDict()
    config.mesh.trainer = dict(devices=2, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=2, axes=dict(data=1, fsdp=1, tensor=-1))
    # Logical axis -> mesh axes (MaxText style); the first unused match wins per array. The table is the library's
    # (arealjax/sharding.py DEFAULT_RULES, which models and trainer use when given no rules); a recipe edits a copy.
    config.sharding_rules = list(DEFAULT_RULES)

    # The task: "47+85=" -> "7+5=12,4+8+1=13;132" (arealjax/data/arithmetic.py), answers checked exactly.
    config.task = ml_collections.ConfigDict()
    config.task.name = "addition"  # or "remainder", the long-tail task (configs/longtail.py)
    config.task.seed = 0
    config.task.min_digits = 2
    config.task.max_digits = 3

    # A converted dataset (python -m arealjax.data.convert; see docs/data.md); empty = the synthetic task above.
    config.data = ml_collections.ConfigDict()
    config.data.path = ""  # e.g. /data/tfds/gsm8k/1.0.0
    config.data.split = "train"
    config.data.eval_split = "test"  # eval.num_problems held-out prompts from it
    config.data.seed = 0  # shuffle
    config.data.epochs = 0  # 0 = endless
    config.data.template = "chat"  # the tokenizer's chat template, or a string with {prompt}
    config.data.instruction = "{prompt}"  # the user message, the question in it as {prompt}
    config.data.max_prompt_tokens = 32  # longer prompts are skipped and counted

    # SFT warm start on demonstrations that forget each carry with probability demo_error (0 steps = none).
    config.sft = ml_collections.ConfigDict()
    config.sft.steps = 600
    config.sft.cache_dir = ""  # where the warm-started model is cached; empty = workdir/sft
    config.sft.batch_size = 64
    config.sft.demo_error = 0.7
    # A converted SFT dataset (layout 'sft': chat messages, or prompt + response) instead of the demonstrations.
    config.sft.data = dict(path="", split="train", epochs=0)
    config.sft.max_tokens = 128
    config.sft.micro_rows = 32
    # lr: the carried sums ("8+9+1=18") are rare in the demonstrations (most carries are forgotten); at 3e-3 one warm
    # start in six, by seed and by machine, had not learned them and its RL climbed far slower (docs/figures.md,
    # "Learning over seeds"); at 1.5e-3 every one of six had.
    config.sft.optim = dict(lr=1.5e-3, schedule="cosine", warmup_steps=20, total_steps=0,  # 0 = sft.steps
                            min_lr_ratio=0.1, weight_decay=0.01)

    # Async RL: B prompts x n samples per step; admission keeps staleness <= max_staleness (0 = synchronous).
    config.rl = ml_collections.ConfigDict()
    config.rl.steps = 60
    config.rl.batch_size = 16
    config.rl.group_size = 8
    config.rl.max_staleness = 2
    config.rl.max_concurrent = 64  # prompts in flight
    # When dynamic filtering drops this many groups in a row the trainer would starve: if every sample of them got
    # ≥ solved_reward the task is solved and the run ends as completed (summary.json says so), else with an error.
    # Solved too when solved_share of the last solved_window groups were all right (0 = off): near 100% each kept
    # group costs many samples (slow steps) and teaches nothing the held-out set can show.
    config.rl.max_filtered_in_a_row = 500
    config.rl.solved_reward = 1.0
    config.rl.solved_window = 256
    config.rl.solved_share = 0.95
    # Rollout sampling: temperature, then top_k (0: off) and top_p (1: off) truncation. Behaviour logprobs are of the
    # tempered distribution over the whole vocabulary, the one the trainer computes.
    config.rl.temperature = 1.0
    config.rl.top_k = 0
    config.rl.top_p = 1.0
    config.rl.max_new_tokens = 40
    config.rl.eval_every = 10

    config.advantage = dict(estimator="grpo", filter_uniform=True)
    config.rewards = ml_collections.ConfigDict()
    config.rewards.fn = "arealjax.data.arithmetic:reward"  # any "module:function(completion, **kwargs)"
    config.rewards.workers = 2
    config.rewards.timeout = 10.0  # per attempt; a stuck worker is killed and replaced
    config.rewards.retries = 1  # attempts after a failure (raised, timed out, worker died)
    config.rewards.failure_reward = 0.0  # the reward of a call that failed every attempt
    # A reward function failing on more than this share of the last failure_window calls is broken: stop the run.
    config.rewards.max_failure_rate = 0.5
    config.rewards.failure_window = 64
    config.rewards.concurrency = 32  # calls in flight at once of an `async def` function (a judge): no workers
    # A judge model as the reward (rewards.fn = "arealjax.rewards.judge:judge"): any OpenAI-compatible endpoint.
    config.rewards.judge = ml_collections.ConfigDict()
    config.rewards.judge.base_url = ""  # e.g. "http://127.0.0.1:8000/v1" (python -m arealjax.serve --model=DIR)
    config.rewards.judge.model = ""  # "" = the first of the endpoint's GET /models
    config.rewards.judge.prompt = ""  # over {prompt}, {completion} and the row's fields; "" = judge.DEFAULT_PROMPT
    config.rewards.judge.parse = "number"  # "number" (/ max_score) | "yes_no" | "json:FIELD" (/ max_score)
    config.rewards.judge.max_score = 10.0
    config.rewards.judge.max_tokens = 16  # of the judge's reply
    config.rewards.judge.timeout = 8.0  # per reply, below rewards.timeout
    config.rewards.judge.api_key_env = ""  # the environment variable holding the endpoint's key
    config.rewards.judge.serve = ""  # a model directory the run serves itself as the judge (instead of base_url)
    config.rewards.judge.serve_args = ""  # its `python -m arealjax.serve` flags, e.g. "--slots=32 --max-len=2048"
    config.rewards.judge.serve_env = "JAX_PLATFORMS=cpu"  # its environment: devices the run leaves free

    # One dataset sample -> one trajectory (arealjax/workflows): "arealjax.workflows:RLVR" (single turn),
    # "arealjax.workflows:MultiTurn" (answer -> feedback -> retry), "arealjax.workflows:ToolCalls" (code in the
    # sandbox), or any "module:Class" with `async def run(self, episode)`.
    config.workflow = ml_collections.ConfigDict()
    config.workflow.path = "arealjax.workflows:RLVR"
    config.workflow.kwargs = {}

    config.trainer = ml_collections.ConfigDict()
    config.trainer.max_tokens = 128  # packed row length
    config.trainer.micro_rows = 16
    # Optimizer steps per RL step, each on 1/n of the batch. With 1, π_θ = π_prox at the only update and the
    # decoupled objective's clip never acts (docs/objectives.md).
    config.trainer.ppo_n_minibatches = 1
    config.trainer.router_replay = True  # MoE models: route each token through the experts the generator chose
    # The objective (arealjax/rl/losses.py; docs/objectives.md says which to use when, from the measurements):
    # standard (PPO's ratio π_θ/μ clipped: a trust region around the behaviour policy) | decoupled (AReaL's:
    # π_θ/π_prox clipped, weighted by π_prox/μ) | gspo | cispo | m2po, and decoupled's correction of the behaviour
    # weight: none | truncate (token TIS) | mask (token MIS; behaviour_lower > 0: IcePop) | sequence_mask |
    # sequence_token_mask | prob_gap.
    config.trainer.ppo = dict(objective="standard", eps_clip=0.2, eps_clip_higher=placeholder(float),
                              c_clip=placeholder(float), behaviour_weight="mask", behaviour_cap=5.0,
                              behaviour_lower=0.0, cispo_cap=5.0, cispo_lower=0.0, sequence_cap=2.0,
                              sequence_lower=0.5, prob_gap=0.2,
                              sequence_eps_clip=3e-4, sequence_eps_clip_higher=4e-4, m2_threshold=0.04, kl_coef=0.0,
                              kl_estimator="k3", drift_warning=0.05)
    config.trainer.optim = dict(lr=5e-4, warmup_steps=5, grad_clip=1.0)
    config.trainer.max_skipped_in_a_row = 3  # steps skipped for a non-finite loss/gradient before the run stops
    # Memory and speed (the numbers stay within float tolerance): attention kernel ("auto": our Pallas flash
    # kernel on GPU / TPU, block-sparse einsums on CPU; "flash": pure-JAX flash for long rows anywhere), per-layer
    # remat (none | full | save_dots | offload | auto: the least recomputation that fits the device's memory),
    # layers under lax.scan, logits computed logits_chunk tokens of a row at a time, and the matmul dtype
    # ("bfloat16" on fp32 master params).
    config.trainer.attention = "auto"
    config.trainer.remat = "none"
    config.trainer.scan_layers = True
    config.trainer.logits_chunk = 1024
    config.trainer.compute_dtype = "float32"
    # A group's prompt and an agent's history computed once per step: trajectories packed as a tree of shared
    # prefixes (docs/trainer.md; same values as packed flat, fewer tokens; where the attention kind cannot read a
    # tree, flat, said at start-up).
    config.trainer.share_prefixes = True
    # LoRA (arealjax/models/lora.py): rank > 0 trains low-rank adapters on `targets` of every layer (scaled by
    # alpha / rank) and freezes the rest; the optimizer state and the weight sync are the adapters' only. The
    # generator serves base + adapters "merged" (W + (α/r)·A·B once per version) or "on_the_fly" (two thin
    # matmuls per projection per token); the run's model is exported "merged" or as "adapters" (PEFT's format).
    # The SFT warm start, if any, trains the full model before the adapters are added.
    config.lora = ml_collections.ConfigDict()
    config.lora.rank = 0
    config.lora.alpha = 16.0
    config.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    config.lora.generator = "merged"
    config.lora.export = "merged"

    # The interruptible generator (arealjax/generation): KV-cache slots, cache length, weight-swap mode.
    config.generator = ml_collections.ConfigDict()
    # The rollout backend (arealjax/generation/__init__.py): "local" = the generator in this process on its own
    # devices; "remote" = generation servers in their own processes (docs/servers.md), which take mesh.generator; or
    # the path of a module of your own.
    config.generator.backend = "local"
    config.generator.servers = ml_collections.ConfigDict()
    config.generator.servers.address = "127.0.0.1:0"  # where the trainer listens for servers (port 0: any free one)
    config.generator.servers.spawn = 0  # servers this process starts on its host (0: started elsewhere)
    config.generator.servers.min = 1  # servers to wait for before training starts
    config.generator.servers.start_seconds = 300.0  # for spawned servers to say hello and `min` of them to be ready
    config.generator.servers.wait_seconds = 300.0  # for one to (re)join when none is left
    config.generator.servers.heartbeat_seconds = 10.0  # a server silent this long is dropped; the reverse: it stops
    config.generator.servers.verify = False  # servers report a fingerprint of the weights they got, every update
    # The wire's trust (docs/servers.md, "Security"): "auto" = CURVE (encrypted, only servers holding a key of
    # `keys` join) unless the address is loopback; "curve"; "none" (anyone who reaches the port joins).
    config.generator.servers.auth = "auto"
    config.generator.servers.keys_dir = ""  # a keys folder (--new-keys=DIR); spawned servers: a pair made per run
    config.generator.servers.progress_seconds = 300.0  # a server with requests and no new token this long: stuck
    config.generator.servers.respawns = 3  # restarts of each spawned server that exits or is dropped
    # The cores of each spawned server: one set for all ("1") or one per server, ";" between ("1;2-3"); empty = all.
    config.generator.servers.cpus = ""
    config.generator.slots = 128
    config.generator.max_len = 64  # prompt + output tokens per sequence
    config.generator.mode = "recompute"  # on a weight swap: re-prefill in-flight slots (AReaL) | "keep" stale KV
    config.generator.decode_steps = 8  # decode steps per device call
    config.generator.max_prefill_batch = 16
    # Paged KV cache: pages of page_size tokens; kv_pages = 0 sizes the pool for every slot at max_len (no
    # preemption), fewer pages hold less memory and preempt (re-prefill later) when a decode step runs out.
    config.generator.page_size = 16
    config.generator.kv_pages = 0
    config.generator.attention = "auto"  # "auto": a Pallas paged kernel on GPU / TPU, "ragged" (pure JAX) elsewhere
    config.generator.prefill_attention = "auto"  # prompt attention, as trainer.attention
    config.generator.dtype = "float32"  # params and KV cache; "bfloat16" halves both (the weight sync casts)

    # Weights & Biases beside metrics.jsonl and TensorBoard (pip install wandb): off while project is empty. mode
    # "offline" writes workdir/wandb for a later `wandb sync`; a resumed run continues its W&B run.
    config.wandb = dict(project="", entity="", name="", group="", tags=(), mode="online")
    config.curves = True  # draw workdir/curves.png at the end (matplotlib: ~1 s of CPU); benchmark cells leave it off

    # orbax checkpoints of the whole RL state (see arealjax/checkpoint.py); resume continues the latest one.
    config.resume = False
    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.dir = ""  # empty = workdir/checkpoints; gs://bucket/run works too
    config.checkpoint.every_steps = 20
    config.checkpoint.every_seconds = 0.0  # also save when this much time has passed (0 = off)
    config.checkpoint.max_to_keep = 3

    # Held-out evaluation (arealjax/evaluate.py; also `python -m arealjax.evaluate`): n samples per problem at
    # eval.temperature (-1: rl.temperature) → pass@k / maj@k / mean@k for each k ≤ n, plus one greedy sample.
    config.eval = ml_collections.ConfigDict()
    config.eval.num_problems = 256  # the first N of data.eval_split (0 = all of it)
    config.eval.n = 1
    config.eval.k = (1,)
    config.eval.temperature = -1.0
    config.eval.greedy = True
    # True: every sample is an episode of the run's workflow (an agent evaluated as it is trained: its prompt, tools,
    # turns and reward); False: one completion of the templated prompt.
    config.eval.workflow = False
    config.eval.answer_fn = "arealjax.data.arithmetic:extract_answer"  # final answers for maj@k ('' = none)
    # True: each evaluation runs on a generator of its own holding the step's weights, while training goes on
    # (arealjax/concurrent_eval.py; the trainer waits only for one still running when the next is due). False: the
    # trainer waits while the rollout generator evaluates. In-process generator (generator.backend = local) and one
    # process only.
    config.eval.concurrent = False
    return config


def on_accelerators(config: ml_collections.ConfigDict, max_prompt: int, max_new: int) -> None:
    """What the real-model recipes (configs/math.py, code.py, smollm2.py) share: one host of 8 accelerators, 4
    training (FSDP) and 4 generating (tensor parallel); the AReaL paper's RL sizes and PPO hyper-parameters; bf16;
    rows and contexts of `max_prompt` + `max_new` tokens; 4 samples per held-out problem."""
    config.cpu_devices = 0  # real accelerators
    config.data.template = "chat"
    config.mesh.trainer = dict(devices=4, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=4, axes=dict(data=1, fsdp=1, tensor=-1))

    config.rl.steps = 250
    config.rl.batch_size = 64
    config.rl.group_size = 16
    config.rl.max_staleness = 4
    config.rl.solved_window = 0  # real datasets: easy prompts all right is no reason to stop training the rest
    config.rl.max_concurrent = 256
    config.rl.temperature = 1.0
    config.rl.max_new_tokens = max_new
    config.rl.eval_every = 25
    config.advantage = dict(estimator="grpo", filter_uniform=True, reward_bias=-0.5, reward_scale=10.0,
                            normalize_batch=True)
    config.rewards.workers = 16
    config.rewards.timeout = 30.0

    config.trainer.max_tokens = max_prompt + max_new  # one row holds the longest trajectory
    config.trainer.micro_rows = 1
    config.trainer.ppo_n_minibatches = 4
    config.trainer.optim = dict(lr=2e-5, weight_decay=0.05, b1=0.9, b2=0.95, eps=1e-5, grad_clip=1.0)
    config.trainer.attention = "auto"
    config.trainer.remat = "full"
    config.trainer.compute_dtype = "bfloat16"
    config.trainer.logits_chunk = 1024

    config.generator.slots = 256
    config.generator.max_len = max_prompt + max_new
    config.generator.decode_steps = 16
    config.generator.max_prefill_batch = 32
    config.generator.dtype = "bfloat16"
    config.generator.kv_pages = 0

    config.checkpoint.every_steps = 10
    config.eval.n = 4
    config.eval.k = (1, 4)


def on_two_cores(config: ml_collections.ConfigDict) -> None:
    """A real-model recipe at model=tiny: the same job at a size that runs on 2 CPU cores (CI, tests/test_main.py),
    on fake CPU devices, two per role."""
    config.cpu_devices = 4
    config.mesh.trainer = dict(devices=2, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=2, axes=dict(data=1, fsdp=1, tensor=-1))
    config.rl.steps, config.rl.batch_size, config.rl.group_size = 3, 4, 4
    config.rl.max_staleness, config.rl.max_concurrent = 2, 16
    config.rl.eval_every = 3
    config.advantage.filter_uniform = False  # a random model scores all samples alike: train on them anyway
    config.rewards.workers, config.rewards.timeout = 2, 10.0
    config.trainer.max_tokens, config.trainer.micro_rows = 128, 4
    config.trainer.remat, config.trainer.compute_dtype = "none", "float32"
    config.generator.slots, config.generator.max_len, config.generator.decode_steps = 32, 128, 8
    config.generator.max_prefill_batch, config.generator.dtype = 8, "float32"
    config.checkpoint.every_steps = 3
    config.eval.num_problems, config.eval.n, config.eval.k = 8, 4, (1, 2, 4)
