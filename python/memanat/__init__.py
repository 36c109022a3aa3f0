"""memanat: where the GPU memory of a transformer's training step goes, and whether it fits.

The estimator is memanat.h, the same C header the ``memanat`` command-line tool is built from,
compiled into this package; the numbers are the CLI's to the byte.

    import memanat
    e = memanat.estimate("llama-3-8b", batch=1, seq=2048, precision="bf16", gpu="h100-80gb")
    e.fits, e.breakdown["activations"], e.device_used    # True, bytes, bytes
    memanat.fit("llama-3-8b", gpu="a10g").plan          # what to turn on so that it fits

Settings are the CLI's flags without dashes (``--lora-rank 16`` is ``lora_rank=16``); counts
take ints or the CLI's text (``"7e9"``, ``"350M"``), sizes take bytes or text (``"16GiB"``).
Bad input raises a :class:`MemanatError` subclass carrying the library's one-line message.
"""
from __future__ import annotations

import functools
import io
import json
import os
import pickle
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

from . import _native

__all__ = [
    "estimate", "fit", "replay", "models", "options",
    "Estimate", "Fit", "PlanStep", "Replay",
    "MemanatError", "InvalidArgumentError", "ParseError", "NotFoundError", "UnsupportedError",
    "CATEGORIES",
]
__version__ = "0.1.0"

#: The memory categories of a breakdown, in the order the CLI prints them.
CATEGORIES: Tuple[str, ...] = (
    "weights", "master_weights", "gradients", "optimizer", "activations", "temporary",
    "kv_cache", "workspace",
)


# ---- errors -------------------------------------------------------------------------------------

class MemanatError(Exception):
    """A request the library refused. ``str(err)`` is its one-line reason.

    Attributes:
        code: the library's ``mn_result`` (negative).
        message: the reason, naming the setting and the value.
    """

    result_name = "MN_ERR"

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidArgumentError(MemanatError, ValueError):
    """A setting out of range or inconsistent (MN_ERR_INVALID_ARG)."""

    result_name = "MN_ERR_INVALID_ARG"


class ParseError(MemanatError, ValueError):
    """Malformed text: a config.json, a snapshot (MN_ERR_PARSE)."""

    result_name = "MN_ERR_PARSE"


class NotFoundError(MemanatError, LookupError):
    """An unknown name: model preset, GPU, setting (MN_ERR_NOT_FOUND)."""

    result_name = "MN_ERR_NOT_FOUND"


class UnsupportedError(MemanatError, ValueError):
    """A valid request the library cannot serve, e.g. a mixture-of-experts config."""

    result_name = "MN_ERR_UNSUPPORTED"


class _OverflowError(MemanatError, OverflowError):
    result_name = "MN_ERR_OVERFLOW"


class _IOError(MemanatError, OSError):
    result_name = "MN_ERR_IO"


class _MemoryError(MemanatError, MemoryError):
    result_name = "MN_ERR_OUT_OF_MEMORY"


_ERRORS = {
    -1: InvalidArgumentError, -2: _MemoryError, -3: _OverflowError, -4: ParseError,
    -5: _IOError, -6: NotFoundError, -7: UnsupportedError,
}


def _call(op: str, request: Mapping[str, Any]) -> Dict[str, Any]:
    """One operation of bind/memanat_api.h; raises the error class of its result code."""
    code, raw = _native.call(op, json.dumps(request, separators=(",", ":")))
    text = raw.decode("utf-8", errors="replace")
    if code != 0:
        raise _ERRORS.get(code, MemanatError)(text, code)
    return json.loads(text)


# ---- settings -----------------------------------------------------------------------------------

_MODEL_KEYS = ("model", "config", "config_json", "params")
_OUTPUT_KEYS = ("parts", "explain", "svg")


@functools.lru_cache(maxsize=1)
def _options() -> Tuple[str, ...]:
    return tuple(_call("options", {})["options"])


def options() -> List[str]:
    """The setting names :func:`estimate` and :func:`fit` accept (the CLI's flags)."""
    return [k for k in _options()
            if k not in _OUTPUT_KEYS and k not in ("config_json", "seq_lengths_text",
                                                      "safetensors", "safetensors_index")]


def _config_request(config: Any) -> Dict[str, Any]:
    """The model part of a request from what a user holds."""
    if config is None:
        return {}
    if isinstance(config, bool):
        raise TypeError("config: want a path, a preset name, a dict or a PretrainedConfig")
    if isinstance(config, int):
        return {"params": config}
    if isinstance(config, Mapping):
        return {"config_json": json.dumps(dict(config))}
    if hasattr(config, "to_json_string") and hasattr(config, "model_type"):
        # transformers.PretrainedConfig: every attribute, defaults included
        return {"config_json": config.to_json_string(use_diff=False)}
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.exists(path) or isinstance(config, os.PathLike) or os.sep in path \
                or path.endswith(".json"):
            return {"config": path}  # a file or folder (a missing one: the library says so)
        return {"model": path}
    raise TypeError("config: want a path, a preset name, a parameter count, a dict or a "
                    "transformers PretrainedConfig, got %s" % type(config).__name__)


def _request(config: Any, setup: Mapping[str, Any], fn: str) -> Dict[str, Any]:
    known = set(options()) | ({"parts", "explain", "lengths"} if fn == "estimate" else set())
    for key in setup:
        if key not in known:
            raise TypeError("%s() got an unexpected keyword argument %r (settings: %s)"
                            % (fn, key, ", ".join(sorted(known))))
    req = _config_request(config)
    given = [k for k in _MODEL_KEYS if setup.get(k) is not None]
    if req and given:
        raise TypeError("%s(): give the model once (positional config, or one of %s)"
                        % (fn, ", ".join(_MODEL_KEYS)))
    lengths = setup.get("lengths")
    setup = {k: v for k, v in setup.items() if k != "lengths"}
    req.update({k: _plain(k, v) for k, v in setup.items() if v is not None})
    if lengths is not None:  # the text of a lengths file: one sequence length a line
        if isinstance(lengths, (str, bytes)) or not all(isinstance(n, int) for n in lengths):
            raise TypeError("lengths: want a list of token counts")
        req["seq_lengths_text"] = "".join("%d\n" % n for n in lengths)
    if req.get("alloc_conf") is None:  # as the CLI does
        env = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        if env is not None:
            req["alloc_conf"] = env
    return req


def _plain(key: str, value: Any) -> Any:
    """A setting as JSON: paths as text, everything else as given."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if key == "seq_lengths" and not isinstance(value, str):
        raise TypeError("seq_lengths: a lengths file or \"MIN:MAX:MEAN\"; give a list of "
                        "lengths as lengths=[...]")
    if key == "config" and isinstance(value, Mapping):
        raise TypeError("config=: a path; give a dict as the positional config")
    return value


# ---- results ------------------------------------------------------------------------------------

class Estimate(Mapping[str, Any]):
    """The memory of one training step (or generation) per GPU, in bytes.

    A read-only mapping with the keys of ``memanat estimate --json`` (``weights``, ...,
    ``device_used``, ``capacity``, ``fits``, and the resolved settings), also readable as
    attributes: ``e.peak_reserved``, ``e.fits``.
    """

    def __init__(self, data: Dict[str, Any], request: Dict[str, Any]) -> None:
        self._data = data
        self._request = request
        self._svg: Optional[str] = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_data"][key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def breakdown(self) -> Dict[str, int]:
        """Bytes per memory category (the rows of the CLI's table) plus allocator slack and
        the CUDA context; they add up to ``device_used``."""
        d = self._data
        out = {k: d[k] for k in CATEGORIES}
        out["allocator_slack"] = d["peak_reserved"] - d["peak_allocated"]
        out["context"] = d["context"]
        return out

    @property
    def at_peak(self) -> Dict[str, int]:
        """Bytes per category live at the moment of peak allocation (they sum to it)."""
        return dict(self._data["at_peak"])

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict, ``json.dumps``-able."""
        return json.loads(json.dumps(self._data))

    def to_svg(self) -> str:
        """The timeline of the predicted step, the picture ``memanat estimate --svg`` draws."""
        if self._svg is None:
            req = dict(self._request)
            req["svg"] = True
            self._svg = _call("estimate", req)["svg"]
        return self._svg

    def _repr_svg_(self) -> str:  # Jupyter shows the timeline
        return self.to_svg()

    def __repr__(self) -> str:
        d = self._data
        return ("Estimate(%s on %s: %.2f GiB of %.2f GiB, %s)"
                % (d["model"], d["gpu"], d["device_used"] / 2**30, d["capacity"] / 2**30,
                   "fits" if d["fits"] else "does not fit"))


class PlanStep(NamedTuple):
    """One technique of a plan: ``what`` (the CLI flag to add) and ``why`` (what it saves)."""

    what: str
    why: str

    @property
    def settings(self) -> Dict[str, Any]:
        """``what`` as keywords of :func:`estimate`: ``{"lora_rank": "16", "quant": "nf4"}``."""
        words = self.what.split()
        out: Dict[str, Any] = {}
        i = 0
        while i < len(words):
            key = words[i][2:].replace("-", "_")
            if i + 1 < len(words) and not words[i + 1].startswith("--"):
                out[key], i = words[i + 1], i + 2
            else:
                out[key], i = True, i + 1
        return out


class Fit:
    """The answer of ``memanat fit``: the largest micro-batch at the given sequence, the longest
    sequence at the given batch, and the cheapest plan of techniques that fits."""

    def __init__(self, data: Dict[str, Any], request: Dict[str, Any]) -> None:
        self.max_batch: int = data["max_batch"]
        self.max_seq: int = data["max_seq"]
        self.plan_found: bool = data["plan_found"]
        self.plan_slowdown: float = data["plan_slowdown"]
        self.plan: List[PlanStep] = [PlanStep(p["what"], p["why"]) for p in data["plan"]]
        self.estimate = Estimate(data["estimate"], request)
        self._data = data

    def to_dict(self) -> Dict[str, Any]:
        """The object ``memanat fit --json`` prints."""
        return json.loads(json.dumps(self._data))

    def __repr__(self) -> str:
        return ("Fit(max_batch=%d, max_seq=%d, plan=%s)"
                % (self.max_batch, self.max_seq, [p.what for p in self.plan]))


class Replay(Mapping[str, Any]):
    """Allocator statistics of a replayed trace: ``torch.cuda.memory_stats()`` keys
    (``"allocated_bytes.all.peak"``, ``"num_ooms"``, ...) and the replay's own counts."""

    def __init__(self, data: Dict[str, Any], request: Dict[str, Any]) -> None:
        self._data = data
        self._request = request

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def peak_allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated()`` would report."""
        return int(self._data["allocated_bytes.all.peak"])

    @property
    def peak_reserved(self) -> int:
        """What ``torch.cuda.max_memory_reserved()`` would report."""
        return int(self._data["reserved_bytes.all.peak"])

    def to_svg(self) -> str:
        """The memory timeline of the replay, stacked by category."""
        req = dict(self._request)
        req["svg"] = True
        return _call("replay", req)["svg"]

    def __repr__(self) -> str:
        return ("Replay(peak allocated %.1f MiB, peak reserved %.1f MiB, %d OOMs)"
                % (self.peak_allocated / 2**20, self.peak_reserved / 2**20,
                   self._data["num_ooms"]))


# ---- the calls ----------------------------------------------------------------------------------

def estimate(config: Any = None, **setup: Any) -> Estimate:
    """Memory of one training step (or, with ``infer=True``, a generation) per GPU.

    Args:
        config: the model: a preset name (``"llama-3-8b"``, see :func:`models`), a path to a
            ``config.json`` or a model folder (whose safetensors headers give the exact
            parameter count), a ``dict`` of a config.json, a ``transformers.PretrainedConfig``,
            or an ``int`` parameter count. The keywords ``model=``, ``config=`` (a path) and
            ``params=`` say the same explicitly.
        **setup: the CLI's flags, e.g. ``batch=4, seq=2048, precision="bf16", optim="adamw-8bit",
            checkpointing="full", lora_rank=16, quant="nf4", gpus=8, zero=3, gpu="a100-80gb",
            context="1343MiB"``. ``None`` means the default. ``parts=True`` adds ``"parts"``:
            the activation bytes each block keeps for backward (``memanat estimate --parts``);
            ``explain=True`` adds ``"explain"``: every buffer alive at the peak, grouped by the
            mechanism that made it (``memanat estimate --explain``).
            ``seq_lengths="64:2048:300"`` (or a lengths file, or ``lengths=[...]``, the token
            counts of the data) replays ``steps`` steps over that distribution instead of one
            ``seq``: the result's ``"seq_lengths"`` holds the CLI's ``--seq-lengths`` answer.
            ``alloc_conf`` defaults to
            ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` as in the CLI.

    Raises:
        TypeError: an unknown keyword. MemanatError subclasses: a value the library refuses.
    """
    req = _request(config, setup, "estimate")
    return Estimate(_call("estimate", req), req)


def fit(config: Any = None, **setup: Any) -> Fit:
    """The largest micro-batch, the longest sequence, and a plan that fits the GPU.

    Takes the arguments of :func:`estimate`.
    """
    req = _request(config, setup, "fit")
    return Fit(_call("fit", req), req)


def models() -> Dict[str, List[Dict[str, Any]]]:
    """The model presets (``"models"``) and the GPU table (``"gpus"``) the names refer to."""
    data = _call("models", {})
    return {"models": data["models"], "gpus": data["gpus"]}


class _SnapshotUnpickler(pickle.Unpickler):
    """A torch memory snapshot is plain dicts, lists, strings and numbers; nothing else may be
    built from the file (a pickle can otherwise run code)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            import collections
            return collections.OrderedDict
        raise pickle.UnpicklingError("memanat.replay: the pickle names %s.%s; a memory snapshot "
                                     "holds only plain data" % (module, name))


def _load_snapshot(snapshot: Any) -> Mapping[str, Any]:
    if isinstance(snapshot, Mapping):
        return snapshot
    if isinstance(snapshot, (bytes, bytearray)):
        data = bytes(snapshot)
        label = "snapshot"
    else:
        label = os.fspath(snapshot)
        with open(label, "rb") as f:
            data = f.read()
    if data.lstrip()[:1] == b"{":
        try:
            return json.loads(data)
        except ValueError as err:
            raise ParseError("%s: not valid JSON (%s)" % (label, err), -4) from None
    try:
        return _SnapshotUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise ParseError("%s: neither JSON nor a snapshot pickle (%s)" % (label, err), -4) from None


def replay(snapshot: Any, alloc_conf: Optional[str] = None,
           capacity: Union[int, str, None] = None) -> Replay:
    """Replays a PyTorch memory snapshot's allocations through memanat's caching allocator.

    Args:
        snapshot: the file ``torch.cuda.memory._dump_snapshot()`` writes (a pickle), the same
            saved as JSON, its bytes, or the dict ``torch.cuda.memory._snapshot()`` returns.
        alloc_conf: allocator settings in ``PYTORCH_ALLOC_CONF`` grammar (default: the
            environment's, as in the CLI).
        capacity: device bytes (int or ``"16GiB"``); allocations beyond it count as OOMs.
    """
    snap = _load_snapshot(snapshot)
    traces = snap.get("device_traces") if isinstance(snap, Mapping) else None
    if not isinstance(traces, list):
        raise InvalidArgumentError("replay: no \"device_traces\" list (a PyTorch memory snapshot "
                                   "is expected)", -1)
    keep = ("action", "addr", "size", "stream", "category")
    slim = [[{k: e[k] for k in keep if k in e} for e in dev if isinstance(e, Mapping)]
            if isinstance(dev, list) else dev for dev in traces]
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    req: Dict[str, Any] = {"device_traces": slim, "alloc_conf": alloc_conf, "capacity": capacity}
    return Replay(_call("replay", req), req)
