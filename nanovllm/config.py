"""Engine options: what the user passed, validated, plus the checkpoint's config."""

import dataclasses
import os
from dataclasses import dataclass, field

from nanovllm.checkpoint.hf_config import head_dim, load_hf_config
from nanovllm.sampling_params import MAX_LOGPROBS

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "flash_attn", "triton")
KV_CACHE_DTYPES = ("auto", "fp8")  # fp8: e4m3 with a scale per token and kv head
TOKENIZER_MODES = ("auto", "slow")
# vLLM's logprobs modes: of the raw logits, or of those the draw is from (after penalties,
# temperature and filters); as log-probabilities or as logits.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


# vLLM's names for options this engine has under another name.
ALIASES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks",
           "enable_expert_parallel": "expert_parallel"}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")  # dummy: random weights, loaded later


def _any(value) -> bool:
    return True


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verify step takes 1 + k rows per sequence
DISABLE_BY_BATCH_SIZE = 32  # docs/architecture.md, speculative decoding (budget)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for n-gram (prompt lookup) drafting: up to
    num_speculative_tokens tokens copied from where the sequence's last n tokens (the longest n in
    [prompt_lookup_min, prompt_lookup_max]) occurred before."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    # A decode step of more sequences than this verifies no draft: it keeps the overlap, which
    # pays more than drafts there (docs/architecture.md, speculative decoding).
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE

    @classmethod
    def of(cls, spec) -> "SpeculativeConfig":
        """From vLLM's dict (or a SpeculativeConfig); ValueError naming a bad key or value."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
        spec = {key: value for key, value in spec.items() if value is not None}
        known = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size")
        for key in spec:
            if key not in known:
                raise ValueError(f"speculative_config key {key!r} is not supported; the keys "
                                 f"are {', '.join(known)}")
        method = spec.get("method", "ngram")
        method = "ngram" if method == "[ngram]" else method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={method!r} is not supported; methods: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        lookup_max = spec.get("prompt_lookup_max", spec.get("prompt_lookup_min", 5))
        lookup_min = spec.get("prompt_lookup_min", lookup_max)
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens")
        k = spec["num_speculative_tokens"]
        batch = spec.get("disable_by_batch_size", DISABLE_BY_BATCH_SIZE)
        for name, value, low, high in (("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS),
                                       ("prompt_lookup_min", lookup_min, 1, None),
                                       ("prompt_lookup_max", lookup_max, lookup_min, None),
                                       ("disable_by_batch_size", batch, 1, None)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"speculative_config {name} must be an int, got {value!r}")
            if value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"speculative_config {name}={value} must be {bound}")
        return cls(k, lookup_max, lookup_min, method, batch)


# vLLM options that change nothing here: the values this engine honours, and why others fail.
INERT_OPTIONS = {
    "trust_remote_code": (_any, "the supported architectures are built in"),
    "enable_sleep_mode": (_any, "sleep() is always available"),
    "disable_custom_all_reduce": (_any, "there is no custom all-reduce"),
    "disable_mm_preprocessor_cache": (_any, "models are text-only"),
    "disable_log_stats": (_any, "no statistics are logged"),
    "enable_chunked_prefill": (_any, "prefill is always chunked; outputs do not change"),
    "swap_space": (_any, "preemption recomputes: nothing is swapped"),
    "max_seq_len_to_capture": (_any, "the decode graphs cover max_model_len"),
    "compilation_config": (_any, "the decode step runs as CUDA graphs, without torch.compile"),
    "distributed_executor_backend": (lambda v: v in ("mp", "uni"),
                                     "tensor-parallel ranks are processes ('mp')"),
    "model_impl": (lambda v: v in ("auto", "vllm"), "the models are this engine's own"),
    "quantization": (lambda v: False, "quantized weights are not supported (GGUF is dequantized)"),
    "enable_lora": (lambda v: v is False, "LoRA adapters are not supported"),
    "pipeline_parallel_size": (lambda v: v == 1, "pipeline parallelism is not supported"),
    "cpu_offload_gb": (lambda v: v == 0, "weights are not offloaded to the CPU"),
}


def vllm_options(options: dict) -> dict:
    """The options as this engine names them: vLLM's aliases renamed, None meaning the default,
    options that change nothing here dropped (a value this engine cannot honour raises a
    ValueError naming the option and why), torch dtypes as strings."""
    options = {ALIASES.get(name, name): value for name, value in options.items()
               if value is not None}
    for name, (honoured, why) in INERT_OPTIONS.items():
        if name in options and not honoured(value := options.pop(name)):
            raise ValueError(f"{name}={value!r} is not supported: {why}")
    dtype = options.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        options["dtype"] = str(dtype).removeprefix("torch.")
    if isinstance(options.get("dtype"), str):
        options["dtype"] = DTYPE_ALIASES.get(options["dtype"], options["dtype"])
    if options.get("kv_cache_dtype") == "fp8_e4m3":
        options["kv_cache_dtype"] = "fp8"
    return options


def option_names() -> list[str]:
    """The engine options `LLM(model, **options)` takes (besides the data-parallel ones)."""
    return [f.name for f in dataclasses.fields(Config) if f.init and f.name != "model"]


def check_option_names(options: dict, extra: tuple[str, ...] = ()):
    """A TypeError for an option name that is neither an engine option nor in `extra`."""
    known = option_names() + list(extra)
    for name in options:
        if name not in known:
            raise TypeError(f"unknown option {name!r}; valid options are: {', '.join(known)}")


@dataclass
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs' text is ""
    expert_parallel: bool = False  # MoE: whole experts per rank instead of slices of each
    revision: str | None = None  # of a Hugging Face repo id
    gguf_file: str | None = None  # the .gguf file in a repo or directory
    seed: int | None = None  # seeds the sampling noise: requests without a seed repeat too
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # a tokenizer other than the checkpoint's (a path or repo id)
    tokenizer_mode: str = "auto"  # "slow": the Python tokenizer instead of the fast one
    tokenizer_revision: str | None = None
    load_format: str = "auto"  # "dummy": random weights, for update_weights to fill
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    logprobs_mode: str = "raw_logprobs"  # vLLM's: raw or processed, logprobs or logits
    # vLLM's dict ({"method": "ngram", "num_speculative_tokens": k, ...}), a SpeculativeConfig
    speculative_config: SpeculativeConfig | dict | None = None
    hf_config: object = field(init=False, repr=False)

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        """Build a Config, rejecting unknown option names with a clear TypeError."""
        options = vllm_options(options)
        check_option_names(options)
        return cls(model, **options)

    def __post_init__(self):
        self._check_types()
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        from nanovllm.checkpoint.hub import resolve_model
        from nanovllm.models import MODELS

        # The local checkpoint: a directory, or a .gguf file.
        self.model = resolve_model(self.model, self.revision, self.gguf_file)
        self.hf_config = load_hf_config(self.model, MODELS)
        self._check_ranges()
        self._resolve_auto()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)

    def _check_types(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError("model must be a checkpoint directory, a .gguf file or a Hugging Face "
                            f"repo id, got {type(self.model).__name__}")
        for name in ("revision", "gguf_file", "tokenizer", "tokenizer_revision"):
            if not isinstance(getattr(self, name), str | None):
                raise TypeError(f"{name} must be a str or None, got {getattr(self, name)!r}")
        self.model = os.path.expanduser(os.fspath(self.model))
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "tensor_parallel_size", "kvcache_block_size", "num_kvcache_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or isinstance(utilization, bool):
            raise TypeError(f"gpu_memory_utilization must be a float, got {utilization!r}")
        for name in ("enforce_eager", "skip_tokenizer_init", "expert_parallel",
                     "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise TypeError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if self.max_logprobs not in range(MAX_LOGPROBS + 1) or isinstance(self.max_logprobs, bool):
            raise ValueError(f"max_logprobs must be an int in [0, {MAX_LOGPROBS}], got "
                             f"{self.max_logprobs!r}")
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("tokenizer_mode", TOKENIZER_MODES), ("load_format", LOAD_FORMATS),
                              ("logprobs_mode", LOGPROBS_MODES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {allowed}")

    def _check_ranges(self):
        hf = self.hf_config
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        bs = self.kvcache_block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two, got {bs}")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError("num_kvcache_blocks must be -1 (auto) or a positive int, "
                             f"got {self.num_kvcache_blocks}")
        tp = self.tensor_parallel_size
        if not 1 <= tp <= 8:
            raise ValueError(f"tensor_parallel_size must be in 1..8, got {tp}")
        for what, count in (("num_attention_heads", hf.num_attention_heads),
                            ("num_key_value_heads", hf.num_key_value_heads),
                            ("vocab_size", hf.vocab_size)):
            if count % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {what}={count}")
        self._check_experts()

    def _check_experts(self):
        """Mixture of experts: expert_parallel splits the experts, else their intermediate dim."""
        hf, tp = self.hf_config, self.tensor_parallel_size
        num_experts = getattr(hf, "num_experts", 0) or 0
        if not num_experts:
            if self.expert_parallel:
                raise ValueError("expert_parallel=True needs a mixture-of-experts checkpoint, "
                                 f"{self.model!r} has no experts")
            return
        if not 1 <= hf.num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok={hf.num_experts_per_tok} must be in "
                             f"1..num_experts={num_experts}")
        what, count = (("num_experts", num_experts) if self.expert_parallel
                       else ("moe_intermediate_size", hf.moe_intermediate_size))
        if count % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {what}={count}"
                             f"{' (expert_parallel=True)' if self.expert_parallel else ''}")

    def _resolve_auto(self):
        import torch  # deferred: keeps `import nanovllm.config` light

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but no CUDA GPU is visible")
            if self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                                 f"{torch.cuda.device_count()} visible GPU(s)")
        if self.dtype == "auto":
            self.dtype = self._default_dtype()
        if self.attention_backend == "auto":
            if self.device == "cpu":
                self.attention_backend = "torch"
            elif self.kv_cache_dtype == "fp8" or self.dtype == "float32":
                self.attention_backend = "triton"  # flash-attn takes neither
            else:
                self.attention_backend = _cuda_default_backend(head_dim(self.hf_config))
        self._check_backend(torch)

    def _default_dtype(self) -> str:
        if self.device == "cpu":
            return "float32"
        hf = self.hf_config
        checkpoint_dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        dtype = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else "bfloat16"
        return "bfloat16" if dtype == "float32" else dtype

    def _check_backend(self, torch):
        if self.kv_cache_dtype == "fp8":
            if self.attention_backend == "flash_attn":
                raise ValueError("kv_cache_dtype='fp8' needs attention_backend='triton' "
                                 "(or 'torch'): flash-attn cannot read an fp8 KV cache")
            if self.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
                raise ValueError("kv_cache_dtype='fp8' needs a GPU with fp8 support (compute "
                                 f"capability >= 8.9), got {torch.cuda.get_device_capability()}")
        if self.attention_backend == "flash_attn":
            if self.device != "cuda":
                raise ValueError("attention_backend='flash_attn' needs device='cuda'")
            if self.dtype == "float32":
                raise ValueError("attention_backend='flash_attn' takes float16 or bfloat16 only, "
                                 "got dtype='float32' (the 'triton' backend takes float32)")
            if self.kvcache_block_size % 256:
                raise ValueError("attention_backend='flash_attn' needs kvcache_block_size to be a "
                                 f"multiple of 256, got {self.kvcache_block_size}")

    @property
    def max_draft_batch(self) -> int | None:
        """The most sequences a decode step verifying drafts may have; None: no speculation."""
        spec = self.speculative_config
        return None if spec is None else spec.disable_by_batch_size

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_cache_torch_dtype(self):
        import torch

        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype


def _cuda_default_backend(head_dim: int) -> str:
    import torch

    # Hopper: our Triton kernels are the fastest backend (docs/kernels.md); others are unmeasured.
    if torch.cuda.get_device_capability()[0] == 9:
        return "triton"
    if head_dim != 128:  # the flash-attn wheel is built for head_dim 128 only
        return "triton"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "triton"
    return "flash_attn"
