"""`LLM`: offline generation like vLLM's, over an engine-core client.

By default the `EngineCore` runs in its own process (`multiprocess=True`, like vLLM's
`VLLM_ENABLE_V1_MULTIPROCESSING=1`); `multiprocess=False` (or the environment variable
`SERVETWIN_ENABLE_MULTIPROCESSING=0`) keeps it in the caller's process. The engine process is shut
down by `close()`, by leaving a `with LLM(...)` block, when the `LLM` is garbage-collected and at
interpreter exit.
"""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Any, Optional, Sequence, Union

from servetwin.core.engine.engine_args import EngineArgs, apply_batch_defaults
from servetwin.core.engine.metrics_reader import Metric, metrics_from_stats
from servetwin.core.engine.core_client import make_client
from servetwin.core.engine.engine_client import EngineCoreClient, EngineDeadError
from servetwin.core.engine.input_processor import InputProcessor, PromptType, check_priority
from servetwin.core.engine.output_processor import OutputProcessor
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.engine.request_output import RequestOutput
from servetwin.core.sampling_params import SamplingParams


def multiprocess_default() -> bool:
    return os.environ.get("SERVETWIN_ENABLE_MULTIPROCESSING", "1").strip().lower() not in ("0", "false", "no")


def prewarm_tokenizer_import(args: EngineArgs) -> None:
    """Import transformers in a background thread while the engine process starts (they overlap)."""
    if not args.multiprocess or args.skip_tokenizer_init or args.tokenizer == "toy" or args.backend != "torch":
        return
    import threading  # noqa: PLC0415

    def _import() -> None:
        try:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            import transformers  # noqa: F401, PLC0415
        except Exception:  # noqa: BLE001 - load_tokenizer reports problems later
            pass

    threading.Thread(target=_import, name="tokenizer-import", daemon=True).start()


def tokenizer_path(args: EngineArgs, model_path: Optional[str]) -> Optional[str]:
    """The tokenizer the front end loads: `tokenizer`, else the model's own; the `fake` and `sim`
    backends have no vocabulary and get the toy tokenizer (as `servetwin serve` gives them), so text
    prompts, chat and stop strings work there too. None with `skip_tokenizer_init`."""
    if args.skip_tokenizer_init:
        return None
    if args.tokenizer is not None:
        return args.tokenizer
    if model_path is None and args.backend in ("fake", "sim"):
        return "toy"
    return model_path


def load_tokenizer(path: Optional[str], vocab_size: Optional[int] = None) -> Any:
    """A Hugging Face tokenizer from `path`; "toy" gives the `ToyTokenizer` (fake / sim backends)."""
    if path is None:
        return None
    if path == "toy":
        from servetwin.core.engine.toy_tokenizer import ToyTokenizer  # noqa: PLC0415

        return ToyTokenizer(vocab_size or 1024)
    import os  # noqa: PLC0415

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    """Input processing, fan-out, the engine-core client and output processing, in the caller."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        prewarm_tokenizer_import(args)
        self.client = self._make_client(args)
        info = self.client.config
        self.num_gpu_blocks = info.num_gpu_blocks
        self.max_model_len = info.max_model_len
        try:
            self.tokenizer = load_tokenizer(tokenizer_path(args, info.model_path), info.vocab_size)
        except BaseException:
            self.client.shutdown()
            raise
        self.input_processor = InputProcessor(self.tokenizer, info.max_model_len, info.vocab_size,
                                              info.eos_token_ids, args.max_logprobs,
                                              logprobs_backend=args.backend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @staticmethod
    def _make_client(args: EngineArgs) -> EngineCoreClient:
        return make_client(bool(args.multiprocess), False, args)

    def add_request(self, request_id: Optional[str], prompt: PromptType, params: Optional[SamplingParams],
                    arrival_time: Optional[float] = None, priority: int = 0) -> str:
        check_priority(priority, self.args.policy)
        request_id = request_id if request_id is not None else str(next(self._ids))
        processed = self.input_processor.process(prompt, params)
        self.client.validate_params(processed.params)
        children = fan_out(request_id, processed.params)
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, children,
                                          arrival_time)
        added: list[str] = []
        try:
            for cid, child_params in children:
                self.client.add_request(cid, processed.prompt_token_ids, child_params, arrival_time=arrival_time,
                                        priority=priority, parent_id=request_id if len(children) > 1 else None)
                added.append(cid)
        except BaseException:
            self.output_processor.abort(request_id)
            if added:
                self.client.abort_requests(added)
            raise
        return request_id

    def abort_request(self, request_id: str) -> None:
        ids = self.output_processor.abort(request_id)
        if ids:
            self.client.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        try:
            outputs = self.client.get_output()
        except ValueError as e:  # the engine process refused a request (EngineRequestError)
            rid = getattr(e, "request_id", None)
            if rid is not None and rid not in self.output_processor.children:
                return []  # a request this front end already dropped (e.g. after Ctrl-C)
            raise
        if not outputs and self.output_processor.has_unfinished() and not self.client.has_work():
            raise RuntimeError("engine has no work but requests are unfinished (lost requests)")
        client = self.client
        results, to_abort = self.output_processor.process_outputs(outputs, client.last_sim_time_s,
                                                                  client.sim_arrivals)
        if to_abort:
            self.client.abort_requests(to_abort)
        return results

    def shutdown(self) -> None:
        self.client.shutdown()


class LLM:
    """`LLM(model=..., backend="torch"|"sim", **engine_args).generate(prompts, params)`."""

    def __init__(self, model: str = "tiny-llama", backend: str = "torch", **engine_args: Any) -> None:
        engine_args.setdefault("multiprocess", multiprocess_default())
        # the offline LLM's step budget and running cap for the backend's device, as vLLM's LLM picks them
        engine_args = apply_batch_defaults({"backend": backend, **engine_args}, api_server=False)
        self.args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.llm_engine = LLMEngine(self.args)
        # garbage collection and interpreter exit (weakref.finalize runs atexit too) stop the engine
        self._finalizer = weakref.finalize(self, self.llm_engine.client.shutdown)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("LLM was closed")

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        self._check_open()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: must be a string, a list of token ids, a dict, or a list of those, got "
                             f"{type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise ValueError("sampling_params: must be a SamplingParams or a list of them, got "
                                 f"{type(sampling_params).__name__}")
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params_list)} params for {len(prompts)} prompts")
        for i, params in enumerate(params_list):
            if params is not None and not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params[{i}]: must be a SamplingParams, got {type(params).__name__}")
        engine = self.llm_engine
        ids = []
        with engine.client.batched():  # the engine sees all prompts at once, as in-process
            try:
                for prompt, params in zip(prompts, params_list):
                    ids.append(engine.add_request(None, prompt, params))
            except Exception:
                for rid in ids:
                    engine.abort_request(rid)
                raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=len(ids), desc="Processed prompts")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # Ctrl-C, a refused request or a dead engine: drop what is left of this call
            for rid in ids:
                if rid not in finished:
                    try:
                        engine.abort_request(rid)
                    except Exception:  # noqa: BLE001 - the engine may be dead
                        engine.output_processor.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in ids]

    def chat(self, messages: Union[list[dict[str, str]], list[list[dict[str, str]]]],
             sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        self._check_open()
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init=True was given)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
                   for conv in conversations]
        encoded = [{"prompt": p, "prompt_token_ids": list(tok.encode(p, add_special_tokens=False))}
                   for p in prompts]
        return self.generate(encoded, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        self._check_open()
        return self.llm_engine.client.utility("reset_prefix_cache")

    def get_stats(self) -> dict[str, Any]:
        """Scheduler state from the engine core (running / waiting requests, KV usage, preemptions)."""
        self._check_open()
        return self.llm_engine.client.utility("get_stats")

    def get_metrics(self) -> list[Metric]:
        """vLLM's `LLM.get_metrics()`: `Metric` objects (`name`, `labels`, `value` / `values`) with
        vLLM's names, among them the spec-decode counters when speculative decoding is on."""
        return metrics_from_stats(self.get_stats(), self.args.model)

    def close(self) -> None:
        """Stop the engine (its process, in multi-process mode). Safe to call more than once."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
