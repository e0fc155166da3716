"""lm-evaluation-harness on nanovllm: the model "nanovllm" for `lm_eval.simple_evaluate` and the
`lm_eval` command, one in-process LLM underneath. Importing this module registers it (it needs
the `eval` extra: `pip install nanovllm[eval]`); importing nanovllm does not import it.

    import lm_eval, nanovllm.lm_eval
    lm_eval.simple_evaluate(model="nanovllm", model_args="pretrained=Qwen/Qwen3-0.6B",
                            tasks=["hellaswag"])

Scores come from the engine's prompt logprobs, as lm-eval's vLLM backend computes them: each
request is prefilled once with `prompt_logprobs=1` and one generated token."""

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

# Scoring: the prompt's logprobs and its most likely token at each position; the one generated
# token is the engine's minimum and is thrown away.
SCORE_PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)
DEFAULT_MAX_GEN_TOKS = 256  # generate_until without max_gen_toks, as lm-eval's other models


@register_model("nanovllm")
class NanoVLLM(TemplateLM):
    """An lm-eval model over one nanovllm `LLM`: `pretrained` is a model (path, hub id or GGUF)
    and options other than lm-eval's go to `LLM`, or it is an LLM already built, which its
    caller keeps and exits."""

    def __init__(self, pretrained: str | LLM, batch_size: int | str = 1, max_batch_size=None,
                 device: str | None = None, max_length: int | None = None,
                 prefix_token_id: int | None = None, add_bos_token: bool = False,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, **llm_options):
        # batch_size, max_batch_size and device are lm-eval's to every model: the engine batches
        # whatever it is handed (max_num_seqs, max_num_batched_tokens) on the device it finds.
        super().__init__()
        if isinstance(pretrained, LLM):
            if llm_options or max_length is not None:
                raise ValueError("engine options go with a model to load, not with an LLM "
                                 f"already built: {sorted(llm_options) or ['max_length']}")
            self.llm, self.pretrained = pretrained, pretrained.llm_engine.config.model
        else:
            if max_length is not None:
                llm_options.setdefault("max_model_len", int(max_length))
            self.llm, self.pretrained = LLM(pretrained, **llm_options), pretrained
        self.tokenizer = self.llm.tokenizer
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: the given id, else BOS, else EOS (as HFLM)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.llm_engine.limits.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the tokenizer's chat template, as text."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether greedy decoding would produce it) per
        ((context, continuation), context ids, continuation ids)."""
        # The prompt leaves room for the one generated token; a longer one loses its context's
        # oldest tokens (the continuation stays whole while it fits).
        room = self.max_length - 1
        prompts, num_scored = [], []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("loglikelihood needs a non-empty continuation")
            prompts.append((context + continuation)[-room:])
            num_scored.append(min(len(continuation), room - 1))
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], SCORE_PARAMS,
                                    use_tqdm=not disable_tqdm)
        results = []
        for request, prompt, count, output in zip(requests, prompts, num_scored, outputs):
            answer = _score(prompt[-count:], output.prompt_logprobs[-count:])
            if request[0] is not None:  # rolling windows cache their sum instead
                self.cache_hook.add_partial("loglikelihood", request[0], answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance],
                              disable_tqdm: bool = False) -> list[float]:
        """Each whole text's logprob, scored in disjoint windows (the first after
        prefix_token_id), their sums added up. A window of n scored tokens is a prompt of n + 1
        (the token it conditions on first) plus the generated one: n <= max_length - 2."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 2, context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to (without) the first of its `until` strings or EOS,
        at most max_gen_toks tokens; the context keeps its last tokens that leave room for them."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (request.args for request in requests):
            options, until, max_gen_toks = _generation_options(gen_kwargs, eos, self.max_gen_toks)
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for the context "
                                 f"within max_length={self.max_length}")
            prompts.append({"prompt_token_ids":
                            self.tok_encode(context)[-(self.max_length - max_gen_toks):]})
            params.append(SamplingParams(max_tokens=max_gen_toks, stop=until, **options))
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for request, output, until in zip(requests, outputs, stops):
            # Decoded whole without special tokens and cut at the first stop string, as
            # lm-eval's HF model does.
            text = self.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

    def get_model_info(self) -> dict:
        return {"model": self.pretrained, "max_model_len": self.max_length}


def _score(tokens: list[int], prompt_logprobs) -> tuple[float, bool]:
    """The tokens' summed logprobs and whether each was its position's most likely token, from
    their positions' prompt logprobs ({id: Logprob}: the token and the top one)."""
    total, greedy = 0.0, True
    for token, entries in zip(tokens, prompt_logprobs):
        total += entries[token].logprob
        greedy = greedy and entries[token].rank == 1
    return total, greedy


def _generation_options(gen_kwargs: dict, eos: str, default_max_gen_toks: int):
    """lm-eval's generation kwargs as (SamplingParams fields, stop strings, max tokens)."""
    options = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks)
    until = handle_stop_sequences(options.pop("until", None), eos=eos)
    max_gen_toks = int(options.pop("max_gen_toks"))
    options.pop("do_sample", None)  # temperature says it: 0 when do_sample is False
    options.setdefault("temperature", 0.0)  # unset means greedy to lm-eval, 1 to SamplingParams
    # Stop strings are looked for in the text with its special tokens, as HF's stopping criteria
    # and lm-eval's vLLM backend look for them.
    options = {"skip_special_tokens": False, "spaces_between_special_tokens": False} | options
    return options, until, max_gen_toks
