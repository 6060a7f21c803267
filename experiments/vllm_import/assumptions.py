"""What a bench file's names say about the run it measured, and what is assumed where they say nothing.

A `vllm bench serve` result records the client's side only: not the tensor parallel size, the weights'
quantization or the server's vLLM version. Their names often do (`Llama-3.1-405B-FP8`,
`8xh100`, `tp8`, `vllm0.6.3`): `infer_*` read them, a flag always wins, and every value used - from a
flag, the file's names or a default - is listed in one block (`Assumption`), so nothing is filled in
silently.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# A GPU count in front of a GPU name ("8xh100", "4x-H200", "8xH100SXM5") or a TP size ("tp8", "tp_4").
_TP_NAME = re.compile(r"(?i)(?:^|[^a-z0-9])(?:tp[_-]?(\d{1,2})|(\d{1,2})x[_-]?(?:h100|h200|h20|b200|gb200|a100|"
                      r"a10g?|l40s?|l4|mi300x?|mi325x?|mi355x?|gpus?))(?=$|[^0-9])")
# "-FP8" (or "_fp8", ".fp8", "FP8-Dynamic") in a model id: FP8 weights (vLLM reads the checkpoint's
# quantization_config; the bench file keeps only the id)
_FP8_ID = re.compile(r"(?i)(?:^|[-_./])fp8(?:$|[-_.])")
_VERSION_NAME = re.compile(r"(?i)vllm[_-]?v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(slots=True, frozen=True)
class Assumption:
    """One setting the case uses: its value and where it came from (a flag, the file's names, a default)."""
    field: str
    value: str
    source: str

    def line(self) -> str:
        return f"{self.field}: {self.value}" + (f" ({self.source})" if self.source else "")


def infer_tp_from_name(where: str) -> Optional[tuple[int, str]]:
    """(TP size, the part of the file name that says it): `tp8`, or `8xh100` (all GPUs of a server,
    one model: vLLM's usual `--tensor-parallel-size` for a model that needs them)."""
    name = Path(where.split(":")[0]).name
    m = _TP_NAME.search(name)
    if m is None:
        return None
    size = int(m.group(1) or m.group(2))
    return (size, m.group(0).strip("_-. ")) if size >= 1 else None


def infer_fp8(model_id: Optional[str]) -> bool:
    """True when the model id names FP8 weights (`meta-llama/Llama-3.1-405B-FP8`, `...-FP8-Dynamic`)."""
    return bool(model_id) and _FP8_ID.search(model_id.rsplit("/", 1)[-1]) is not None


def infer_version_from_name(where: str) -> Optional[str]:
    """`0.6.3` from a file named `..._vllm0.6.3dev_...` (None: the name says no version)."""
    m = _VERSION_NAME.search(Path(where.split(":")[0]).name)
    if m is None:
        return None
    return ".".join(g for g in m.groups() if g is not None)


def version_tuple(version: str) -> Optional[tuple[int, int]]:
    m = re.match(r"v?(\d+)\.(\d+)", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


# vLLM 0.33's defaults (core/ implements 0.33) that an older server had otherwise, each with the newest
# version the old default applies to and what servetwin does with it: "applied" (`servetwin validate`'s
# VERSION_ENGINE_SETTINGS, from the case's engine_version), else 0.33's is used and the line says why.
OLD_VERSION_DEFAULTS: tuple[tuple[tuple[int, int], str], ...] = (
    ((0, 7), "engine V0 (default up to 0.7; V1 from 0.8): prefills and decodes in separate steps, no chunked "
             "prefill below a 32k max_model_len; used: 0.33's V1 scheduler (chunked prefill, mixed steps) - "
             "servetwin has no V0 scheduler"),
    ((0, 7), "enable_prefix_caching off (V0 default); used: on (0.33) - a hit needs a shared prefix, so random "
             "and ShareGPT prompts are unaffected"),
    ((0, 7), "max_num_seqs 256 (V0 default); used: 0.33's (1024 on an H100-class GPU behind the API server)"),
    ((0, 15), "the API server tokenises in its event loop, so a burst's requests progress together (frontend "
              "ingress: shared, used); 0.33 tokenises on one worker thread, in arrival order (in_order)"),
    ((0, 11), "waiting requests admitted when their first chunk fits the KV pool; 0.33 needs the whole prompt "
              "(engine.scheduler_reserve_full_isl: false, applied)"),
)
# A 0.33 default servetwin does not follow at any version (said in every block).
ASYNC_SCHEDULING = ("async scheduling: on by default in 0.33 (vllm/config/vllm.py turns `None` into True unless an "
                    "option rules it out), off in older versions; used: off (servetwin's default, the one its GPU "
                    "presets were fitted with; --engine async_scheduling=true to change)")


# From this version on, vLLM's API server tokenises (and renders chat templates) on one worker thread
# (vLLM PR #34789, merged 2026-02-19: a single-thread executor in vllm/renderers/base.py; 0.33:
# `renderer_num_workers` = 1), so a burst is admitted one request after another: the case's front end
# gets `ingress: in_order` (sim/frontend.py). The first release carrying the PR is taken to be 0.16 (not
# checked against a release note); the evidence is a 0.19 run (tests/data/vllm_bench, kvcached) that
# in-order admission reproduces and processor sharing does not, and a 0.11 one (B5) the other way round.
IN_ORDER_INGRESS_FROM = (0, 16)


def ingress_for(version: Optional[str]) -> Optional[str]:
    """"in_order" for a version with the single-thread renderer, None where the front end's default holds."""
    vt = version_tuple(version) if version else None
    return "in_order" if vt is not None and vt >= IN_ORDER_INGRESS_FROM else None


def version_assumptions(version: Optional[str]) -> list[str]:
    """The lines saying which of 0.33's defaults the given version had otherwise, and which are used."""
    vt = version_tuple(version) if version else None
    if vt is None:
        return ["0.33's defaults used throughout (the version is unknown)", ASYNC_SCHEDULING]
    lines = [text for newest, text in OLD_VERSION_DEFAULTS if vt <= newest]
    return (lines or [f"none of the scheduler defaults listed for older versions (V0, admission up to 0.11) at "
                      f"{version}"]) + [ASYNC_SCHEDULING]
