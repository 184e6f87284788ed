"""An autoglm-trt engine as a Triton Inference Server model (Python backend, decoupled).

Written into a model repository by ``autoglm-trt triton`` as ``<name>/1/model.py``, beside the
engine (``<name>/1/engine``). Inputs and outputs follow TensorRT-LLM's Triton conventions:
``text_input`` (string), optional ``max_tokens``, ``temperature``, ``top_k``, ``top_p``,
``random_seed``, ``stop_words``, ``stream`` (bool), ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``min_tokens``, ``return_log_probs`` (then ``output_log_probs``: each
generated token's log-probability), ``guided_decoding_guide_type`` / ``guided_decoding_guide``,
and for an image-text engine ``images`` (BYTES: encoded image files, in the order of the
placeholders ``text_input`` holds, e.g. GLM-4.1V's ``<|begin_of_image|><|image|><|end_of_image|>``;
an element may also be a ``data:`` URL, which is what a JSON client such as ``/generate`` can
send); output ``text_output``. A streamed request
gets one response per text piece, then an empty final one; a plain request gets one
response. Continuous batching and the paged KV cache live in the engine, so Triton's dynamic
batcher stays off; each model instance loads its own engine.

Triton's Python-backend stub does not see ``PYTHONPATH``: the directories this model imports
from (this package, its dependencies, and a numpy 1.x that the backend's own utilities are
built for) are the ``python_path`` parameter of ``config.pbtxt``, read here before any import.
"""

import json
import queue
import re
import sys
import threading
from pathlib import Path


def _python_path() -> list:
    config = (Path(__file__).resolve().parents[1] / "config.pbtxt").read_text()
    m = re.search(r'key:\s*"python_path"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config)
    return [p for p in m.group(1).split(":") if p] if m else []


for _p in reversed(_python_path()):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DEFAULT_MAX_TOKENS = 64


class _Pieces:
    """The engine's sink for one request: a queue read by that request's responder thread."""

    def __init__(self):
        self.queue = queue.Queue()

    def put(self, item):
        self.queue.put(item)


def _scalar(request, name, kind):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    v = t.as_numpy().reshape(-1)
    if v.size != 1:
        raise ValueError(f"{name} must hold one value, got {v.size}")
    return kind(v[0])


GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "regex": "regex", "lark": "lark"}


def _guide(request):
    """The output guide TensorRT-LLM's Triton backend names: ``guided_decoding_guide_type`` (json,
    json_schema, regex, or lark: a Lark grammar or a shipped grammar's name) and ``guided_decoding_guide``."""
    from autoglm_trt.errors import RequestError
    from autoglm_trt.runtime import Guide

    kind = _text(request, "guided_decoding_guide_type")
    if not kind:
        return None
    kind, text = kind[0], (_text(request, "guided_decoding_guide") or [""])[0]
    if kind not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
    if kind == "json":
        return Guide.json_object()
    if kind == "lark" and text.replace("_", "").isalnum():
        return Guide.shipped(text)
    return getattr(Guide, GUIDE_TYPES[kind])(text)


def _given(value, default):
    return default if value is None else value


def _text(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    try:
        return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in t.as_numpy().reshape(-1)]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8 text ({exc.reason} at byte {exc.start})") from exc


class TritonPythonModel:
    def initialize(self, args):
        from autoglm_trt.runtime import Engine

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / args["model_version"] / "engine"
        self.engine = Engine.load(engine_dir, threads=int(params.get("threads") or 0),
                                  prefix_caching=params.get("prefix_caching", "true") == "true")
        self.name = args["model_name"]
        labels = {"model": self.name, "instance": args.get("model_instance_name", self.name)}
        gauge = pb_utils.MetricFamily.GAUGE
        # the families must outlive their metrics: both are kept on the model
        self.families = {key: pb_utils.MetricFamily(name=f"autoglm_{metric}", description=text, kind=gauge)
                         for key, metric, text in (("used", "kv_blocks_used", "KV cache blocks in use"),
                                                   ("num_blocks", "kv_blocks_total", "KV cache blocks in the pool"),
                                                   ("running", "requests_running", "Requests being computed"),
                                                   ("waiting", "requests_waiting", "Requests queued for admission"))}
        self.gauges = {key: family.Metric(labels=labels) for key, family in self.families.items()}
        self._stop = threading.Event()
        self._metrics_thread = threading.Thread(target=self._publish_metrics, daemon=True)
        self._metrics_thread.start()

    def _publish_metrics(self):
        while not self._stop.wait(0.25):
            s = self.engine.stats()
            s["used"] = s["num_blocks"] - s["free_blocks"]
            for key, metric in self.gauges.items():
                metric.set(float(s[key]))

    def _parse(self, request):
        from autoglm_trt.errors import RequestError
        from autoglm_trt.runtime import SamplingParams

        text = _text(request, "text_input")
        if not text or len(text) != 1:
            raise RequestError("text_input is required: one string")
        try:
            params = SamplingParams(
                max_new_tokens=_given(_scalar(request, "max_tokens", int), DEFAULT_MAX_TOKENS),
                temperature=_given(_scalar(request, "temperature", float), 0.0),
                top_k=_given(_scalar(request, "top_k", int), 0),
                top_p=_given(_scalar(request, "top_p", float), 1.0),
                seed=_scalar(request, "random_seed", int),
                stop=tuple(s for s in (_text(request, "stop_words") or []) if s),
                frequency_penalty=_given(_scalar(request, "frequency_penalty", float), 0.0),
                presence_penalty=_given(_scalar(request, "presence_penalty", float), 0.0),
                repetition_penalty=_given(_scalar(request, "repetition_penalty", float), 1.0),
                min_tokens=_given(_scalar(request, "min_tokens", int), 0),
                logprobs=0 if _scalar(request, "return_log_probs", bool) else None,
                guide=_guide(request))
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        images = pb_utils.get_input_tensor_by_name(request, "images")
        # each element an encoded image file, or a data: URL (what a JSON client such as /generate can send)
        images = [] if images is None else [x.decode("ascii", "replace") if x.startswith(b"data:") else x
                                            for x in (bytes(v) for v in images.as_numpy().reshape(-1))]
        return text[0], images, params, bool(_scalar(request, "stream", bool))

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True).start()
        return None

    def _serve(self, request, sender):
        """One request on its own thread: parsed, its images decoded and encoded (not on Triton's
        thread, which goes on handing requests out), submitted, answered."""
        from autoglm_trt.errors import AutoGLMError

        try:
            text, images, params, stream = self._parse(request)
            sink = _Pieces()
            handle = self.engine.submit(self.engine.prepare(text, images=images or None), params, sink)
        except (AutoGLMError, ValueError, TypeError) as exc:  # the client's mistake goes back to it
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
            return
        except Exception as exc:  # noqa: BLE001 - anything else still ends the request with one final answer
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc!r}")), flags=FINAL)
            return
        try:
            self._respond(request, handle, sink, sender, stream)
        except Exception:  # noqa: BLE001 - a failed send: the request's client is gone; free its blocks
            self.engine.cancel(handle)

    def _respond(self, request, handle, sink, sender, stream):
        covered = [0]

        def out(text, upto=None):
            """A response with ``text`` and, when asked for, the log-probabilities of its tokens."""
            tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
            if handle.seq.params.logprobs is not None:
                end = len(handle.logprobs) if upto is None else upto
                values = [e.logprob for e in handle.logprobs[covered[0]:end]]
                covered[0] = max(covered[0], end)
                tensors.append(pb_utils.Tensor("output_log_probs", np.array(values, dtype=np.float32)))
            return pb_utils.InferenceResponse(output_tensors=tensors)

        pieces = 0
        while True:
            try:
                piece = sink.queue.get(timeout=0.25)
            except queue.Empty:
                if request.is_cancelled():
                    self.engine.cancel(handle)
                continue
            if piece is None:
                break
            if stream:
                sender.send(out(piece, handle.marks[pieces]))
            pieces += 1
        try:
            result = self.engine.outcome(handle)
        except Exception as exc:  # noqa: BLE001 - the request's own failure goes back to its client
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
            return
        if stream:
            if handle.seq.params.logprobs is not None and covered[0] < len(handle.logprobs):
                sender.send(out(""))  # tokens whose text went out with none (special tokens)
            sender.send(flags=FINAL)
        else:
            sender.send(out(result.text), flags=FINAL)

    def finalize(self):
        self._stop.set()
        self._metrics_thread.join(5)
        self.engine.close()
        self.gauges.clear()
        self.families.clear()
