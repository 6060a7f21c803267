"""The Ray implementation of `servetwin.experiments.sweep.pool.PointPool`: each point is one Ray task.

What travels with a task (nothing is assumed on the worker but the same servetwin version): the
point's validated config, and the bytes of every file it names - `workload.file`, `workload.scenario`,
`workload.arrival.path`, a hardware / calibration YAML given as a path, and a model given as a path (a
`config.json`, or a model folder up to `MAX_MODEL_DIR_BYTES`). The worker writes them to a temporary
folder, points the config there, runs `execute_task`, and sends back the result and, for `write="all"`
tasks, the run folder as a tar archive; the driver unpacks it at the task's `out_dir` and puts the
original paths back into the folder's text files (config.yaml, report.md, run.log), so the folder is
the one a local run writes.

With no address a local Ray instance is started on this machine's CPUs, listening on loopback only;
with an address (`ray start --head` prints it; `auto`; `ray://host:10001`) the driver joins that cluster.
"""
from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import time
from typing import Any, Callable, Optional

from servetwin.experiments.sweep.pool import PointResult, PointTask, execute_task

MAX_MODEL_DIR_BYTES = 256 * 2**20
INSTALL_HINT = "Ray is not installed: pip install 'servetwin[ray]' (or pip install ray)"
TEXT_FILES = (".yaml", ".md", ".log")


class RayUnavailableError(ValueError):
    """`--ray` without Ray installed, or a cluster that cannot be joined."""


def import_ray():
    try:
        import ray  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        raise RayUnavailableError(f"--ray: {INSTALL_HINT}") from None
    return ray


# -- what travels with a task ----------------------------------------------------------------------
def _file_fields(raw: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """(config path, file or folder) of every local file the config names."""
    out: list[tuple[tuple[str, ...], str]] = []
    w = raw.get("workload") or {}
    for key in ("file", "scenario"):
        if isinstance(w.get(key), str):
            out.append((("workload", key), w[key]))
    arrival = w.get("arrival")
    if isinstance(arrival, dict) and isinstance(arrival.get("path"), str):
        out.append((("workload", "arrival", "path"), arrival["path"]))
    for key in ("hardware", "model"):
        if isinstance(raw.get(key), str) and os.path.exists(raw[key]):
            out.append(((key,), raw[key]))
    return out


def _pack_path(path: str) -> bytes:
    buf = io.BytesIO()
    if os.path.isdir(path):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        if size > MAX_MODEL_DIR_BYTES:
            raise RayUnavailableError(
                f"model: {path} is {size / 2**20:.0f} MiB, too large to travel with every task (limit "
                f"{MAX_MODEL_DIR_BYTES // 2**20} MiB); give a preset name or a config.json for the sim")
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(path, arcname=os.path.basename(path.rstrip("/")) or "file")
    return buf.getvalue()


def pack_task(task: PointTask) -> dict[str, Any]:
    """The task as plain data, with the bytes of the files its config names."""
    files = [(fields, path, _pack_path(path)) for fields, path in _file_fields(task.raw)]
    return {"key": task.key, "raw": task.raw, "base_dir": task.base_dir, "write": task.write, "files": files,
            "out_dir": None if task.out_dir is None else os.path.abspath(task.out_dir)}


def _set(raw: dict[str, Any], fields: tuple[str, ...], value: str) -> None:
    node = raw
    for f in fields[:-1]:
        node = node[f]
    node[fields[-1]] = value


def run_packed(payload: dict[str, Any]) -> dict[str, Any]:
    """The Ray task body: unpack the files, run the point, return its result (and its folder as tar)."""
    import copy  # noqa: PLC0415

    tmp = tempfile.mkdtemp(prefix="servetwin-task-")
    try:
        raw = copy.deepcopy(payload["raw"])
        path_map: dict[str, str] = {}
        for i, (fields, original, data) in enumerate(payload["files"]):
            dest = os.path.join(tmp, "in", str(i))
            _extract(data, dest)
            local = os.path.join(dest, os.listdir(dest)[0])
            _set(raw, tuple(fields), local)
            path_map[local] = original
        out_dir = os.path.join(tmp, "out") if payload["write"] == "all" else None
        task = PointTask(payload["key"], raw, tmp, payload["write"], out_dir)
        result = execute_task(task, out_dir, in_worker=True)
        folder = None
        if out_dir is not None and os.path.isdir(out_dir):
            final = payload.get("out_dir") or out_dir
            for name in _text_files(out_dir):
                _replace_paths(name, _path_forms(name, out_dir, final, path_map))
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(out_dir, arcname=".")
            folder = buf.getvalue()
        return {"result": result, "folder": folder, "path_map": path_map}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _text_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(TEXT_FILES)]


def _path_forms(name: str, out_dir: str, final: str, path_map: dict[str, str]) -> dict[str, str]:
    """The staged-file -> original-file map for one text file, in both forms the writers use: absolute,
    and relative to the file's folder (config.yaml names files relative to itself), the relative original
    computed from where the file will lie on the driver (`final`)."""
    here = os.path.dirname(name)
    there = os.path.join(final, os.path.relpath(here, out_dir))
    forms = dict(path_map)
    for local, original in path_map.items():
        try:
            forms[os.path.relpath(local, here)] = os.path.relpath(original, there)
        except ValueError:  # another drive (Windows): only the absolute form applies
            pass
    return dict(sorted(forms.items(), key=lambda kv: -len(kv[0])))  # longest first: no partial replacement


def _replace_paths(path: str, path_map: dict[str, str]) -> None:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        text = f.read()
    new = text
    for local, original in path_map.items():
        new = new.replace(local, original)
    if new != text:
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(new)


def unpack_folder(data: bytes, out_dir: str) -> None:
    """A worker's run folder into `out_dir` (replacing what a previous attempt left there)."""
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    _extract(data, out_dir)


def _extract(data: bytes, dest: str) -> None:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse links and absolute paths
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # noqa: S202 - our own archive, built by pack_task / run_packed


# -- the pool --------------------------------------------------------------------------------------
class RayPool:
    """Each task is a Ray task of one CPU. Joins `address`, or starts a local instance (loopback only)
    that `close` stops; a Ray already initialised in this process (e.g. by a test) is used as it is."""

    def __init__(self, address: Optional[str] = None, cancel_wait_s: float = 60.0) -> None:
        if address is None:
            # a local instance needs no other machine: keep every Ray server on loopback (Ray's own switch,
            # read when ray is imported, for machines where clusters are off)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = import_ray()
        self._ray = ray
        self._owned = False
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, logging_level="WARNING",
                         log_to_driver=False)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise RayUnavailableError(f"--ray {address or ''}: cannot start or join Ray: {e}".replace("  ", " ")) \
                    from None
            self._owned = True
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        where = address or "local instance"
        self.description = f"Ray ({where}, {self.workers} CPUs on {len(ray.nodes())} node(s))"
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run_packed)
        self.cancel_wait_s = cancel_wait_s

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def map(self, tasks: list[PointTask], on_result: Callable[[PointTask, PointResult], None]) -> None:
        ray = self._ray
        refs = {self._remote.remote(pack_task(t)): t for t in tasks}
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    self._report(ref, refs[ref], on_result)
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref)  # queued: dropped; running: KeyboardInterrupt in the task, which stops
            deadline = time.monotonic() + self.cancel_wait_s
            for ref in pending:
                try:
                    ray.wait([ref], timeout=max(0.0, deadline - time.monotonic()))
                    self._report(ref, refs[ref], on_result)
                except KeyboardInterrupt:
                    break
            raise

    def _report(self, ref, task: PointTask, on_result: Callable[[PointTask, PointResult], None]) -> None:
        ray = self._ray
        try:
            out = ray.get(ref, timeout=0)
        except ray.exceptions.TaskCancelledError:
            on_result(task, PointResult("not run"))
            return
        except ray.exceptions.GetTimeoutError:
            on_result(task, PointResult("interrupted", error="still running when the sweep was interrupted"))
            return
        except ray.exceptions.RayError as e:  # the worker died, the node was lost, ...
            on_result(task, PointResult("error", error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
            return
        result: PointResult = out["result"]
        if out["folder"] is not None and task.out_dir is not None:
            unpack_folder(out["folder"], task.out_dir)
        on_result(task, result)

    def close(self) -> None:
        if self._owned and self._ray.is_initialized():
            self._ray.shutdown()
        self._owned = False

