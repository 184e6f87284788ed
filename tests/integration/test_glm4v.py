"""GLM-4.1V (AutoGLM-Phone-9B's architecture) as an engine: prompts with images (one, two, none),
token for token transformers' greedy generation with the same processor output, with and without
the native operators; the prefix cache keyed by image content; the encoder cache; and the image
sources a request may and may not name."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hold_encoder, image_message, random_image, run_cli

from autoglm_trt.errors import RequestError
from autoglm_trt.runtime import Engine, ImageOptions, SamplingParams

IMAGE_TOKEN = 259


def _transformers_greedy(checkpoint, ids: list[int], images: list, new: int) -> list[int]:
    """transformers' greedy tokens for expanded ``ids`` and the images' processor output."""
    import torch
    import transformers

    from autoglm_trt.model.image import ImageConfig, preprocess

    model = transformers.AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    extra = {}
    if images:
        pixels, grids = preprocess(images, ImageConfig.from_dir(checkpoint))
        extra = {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.from_numpy(grids),
                 "mm_token_type_ids": torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]])}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, **extra)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("native", ["1", "0"])
def test_greedy_text_generation_equals_transformers(glm4v_engine, tiny_dir, monkeypatch, native):
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", native)
    prompts = [np.random.default_rng(k).integers(3, 250, n).tolist() for k, n in ((0, 9), (1, 30), (2, 3))]
    with Engine.load(glm4v_engine, prefix_caching=False) as engine:
        assert (engine.backend.attention == "native") == (native == "1")
        results = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _transformers_greedy(tiny_dir("glm4v"), prompt, [], 12)


@pytest.mark.parametrize("native", ["1", "0"])
def test_greedy_with_images_equals_transformers(glm4v_engine, tiny_dir, monkeypatch, native):
    """One image, two images of odd sizes in one prompt, and text alone, batched; prefill chunks of
    24 tokens cut the images, and decode carries the M-RoPE offset."""
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", native)
    a, b, c = random_image(181, 250, 1), random_image(151, 109, 2), random_image(221, 70, 3)
    cases = [(image_message("look: ", a, " what is it?"), [a]),
             (image_message("compare ", b, " with ", c, "."), [b, c]),
             ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], [])]
    with Engine.load(glm4v_engine, prefix_caching=False) as engine:
        prepared = [engine.prepare(msgs) for msgs, _ in cases]
        results = engine.generate([msgs for msgs, _ in cases], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [p.ids.count(IMAGE_TOKEN) for p in prepared][2] == 0
    assert all(p.ids.count(IMAGE_TOKEN) > 24 for p in prepared[:2])  # images span chunk boundaries
    for (_, images), p, result in zip(cases, prepared, results):
        assert result.prompt_tokens == len(p.ids)
        assert result.token_ids == _transformers_greedy(tiny_dir("glm4v"), p.ids, images, 10)


def test_prefix_cache_and_encoder_cache_are_keyed_by_the_image(glm4v_engine):
    """The same screenshot and history again: its blocks and its encoding are reused; one changed
    pixel: the encoder runs again and only the blocks before the image are shared (without the
    image's digest in the block keys, the image's blocks would be hits too, and the answer wrong)."""
    history = "a long agent history that fills several blocks of eight tokens. "
    image = random_image(90, 120, 5)
    changed = np.asarray(image).copy()
    changed[7, 11, 0] ^= 0xFF
    from PIL import Image

    other = Image.fromarray(changed)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with Engine.load(glm4v_engine) as engine:
        first = engine.generate([image_message(history, image, " next?")], params)[0]
        s1 = engine.stats()
        again = engine.generate([image_message(history, image, " next?")], params)[0]
        s2 = engine.stats()
        moved = engine.generate([image_message(history, other, " next?")], params)[0]
        s3 = engine.stats()
        start = engine.prepare(image_message(history, image, " next?")).ids.index(IMAGE_TOKEN)
    with Engine.load(glm4v_engine, prefix_caching=False) as fresh:
        want = fresh.generate([image_message(history, other, " next?")], params)[0]
    assert again.token_ids == first.token_ids
    assert (s2["encoder_cache_hits"], s2["encoder_cache_misses"]) == (s1["encoder_cache_hits"] + 1, 1)
    full_blocks = (first.prompt_tokens - 1) // 8
    assert s2["prefix_hit_tokens"] - s1["prefix_hit_tokens"] == full_blocks * 8
    assert s3["encoder_cache_misses"] == 2
    assert s3["prefix_hit_tokens"] - s2["prefix_hit_tokens"] == start // 8 * 8
    assert moved.token_ids == want.token_ids


def test_image_sources_and_limits(glm4v_engine, tiny_engine, tmp_path):
    image = random_image(40, 40, 7)
    path = tmp_path / "shot.png"
    image.save(path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.png"
    image.save(outside)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)

    def msg(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    with Engine.load(glm4v_engine, images=ImageOptions(max_images=2, allowed_local_media_path=tmp_path)) as engine:
        by_url = engine.generate([image_message(image)], params)[0]
        by_file = engine.generate([msg(path.as_uri())], params)[0]
        by_pil = engine.generate([[{"role": "user", "content": [{"type": "image", "image": image}]}]], params)[0]
        assert by_file.token_ids == by_url.token_ids == by_pil.token_ids
        for prompt, message in [
            (msg("https://example.com/a.png"), "not fetched"),
            (msg(outside.as_uri()), "outside the allowed local media path"),
            (msg("data:image/png;base64,aGVsbG8="), "not an image"),
            (msg("data:image/png;base64,@@@"), "base64"),
            (msg("ftp://x/y.png"), "must be a data: URL"),
            (image_message(image, image, image), r"more than 2 image\(s\)"),
            ([{"role": "user", "content": [{"type": "audio", "data": "x"}]}], "a content part is"),
        ]:
            with pytest.raises(RequestError, match=message):
                engine.generate([prompt], params)
        stats = engine.stats()  # refused requests hold nothing
        assert stats["free_blocks"] == stats["num_blocks"] and stats["waiting"] == stats["running"] == 0
    with Engine.load(glm4v_engine) as engine:  # no allowed path: file URLs are refused
        with pytest.raises(RequestError, match="allowed_local_media_path"):
            engine.generate([msg(path.as_uri())], params)
    with Engine.load(tiny_engine) as text_engine:
        with pytest.raises(RequestError, match="reads text only"):
            text_engine.generate([image_message("hi", image)], params)


def test_max_pixels_bounds_the_image_tokens(glm4v_engine):
    big = random_image(400, 300, 9)
    small_options = ImageOptions(max_pixels=2 * 84 * 84)
    with Engine.load(glm4v_engine) as default, Engine.load(glm4v_engine, images=small_options) as small:
        n_default = default.prepare(image_message(big)).ids.count(IMAGE_TOKEN)
        n_small = small.prepare(image_message(big)).ids.count(IMAGE_TOKEN)
    # each token is 28 x 28 pixels, counted twice (the temporal factor): the tiny preprocessor's longest_edge
    # allows 224 x 224, the option 84 x 84
    assert 48 < n_default <= 64 and 4 < n_small <= 9


@pytest.mark.parametrize("size, attention", [((112, 84), "fused"), ((60, 200), "fused"), ((60, 200), "standard")])
def test_the_vision_encoder_graph_equals_transformers(tiny_dir, tmp_path, size, attention):
    """One image through the exported encoder (host-side position embedding and rope for its grid)
    against transformers' Glm4vVisionModel: the merged image embeddings the decoder takes."""
    import torch
    import transformers

    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph.vision import write_vision_graph
    from autoglm_trt.model.checkpoint import Checkpoint
    from autoglm_trt.model.image import ImageConfig, preprocess
    from autoglm_trt.model.vision import resampled_positions, rope_tables

    ckpt_dir = tiny_dir("glm4v")
    ckpt = Checkpoint.open(ckpt_dir)
    vcfg = ckpt.config["vision_config"]
    image = random_image(*size, seed=size[0])
    pixels, grids = preprocess([image], ImageConfig(patch_size=vcfg["patch_size"], merge_size=vcfg["spatial_merge_size"]))
    _, h, w = (int(x) for x in grids[0])
    head_dim = vcfg["hidden_size"] // vcfg["num_heads"]
    cos, sin = rope_tables(head_dim, vcfg.get("rope_parameters", {}).get("rope_theta", 10000.0), h, w, 2)
    table = ckpt.read("model.visual.embeddings.position_embedding.weight")
    session = make_session(write_vision_graph(ckpt, tmp_path, attention=attention))
    got = session.run(["image_embeds"], {"pixel_values": pixels, "pos_embed": resampled_positions(table, h, w, 2),
                                         "rope_cos": cos, "rope_sin": sin})[0]
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids)).pooler_output.numpy()
    assert got.shape == want.shape == (h * w // 4, ckpt.config["text_config"]["hidden_size"])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def tensorrt_forms(engine_dir, dtype: str):
    """(the fused graph, its TensorRT form in ``dtype``, an image's feeds, the fused graph's output)."""
    import onnx

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.vision_encoder import VisionEncoder
    from autoglm_trt.graph.vision_trt import tensorrt_vision_graph
    from autoglm_trt.model.image import ImageConfig, preprocess

    vision = ExportRecord.read(engine_dir).vision()
    fused = onnx.load(str(engine_dir / "vision.onnx"), load_external_data=False)
    form = tensorrt_vision_graph(fused, vision.head_dim, dtype)
    encoder = VisionEncoder(engine_dir, vision)
    pixels, grids = preprocess([random_image(90, 130, 1)], ImageConfig.from_dir(engine_dir))
    feeds = {"pixel_values": pixels, **encoder.grid_inputs(int(grids[0][1]), int(grids[0][2]))}
    return fused, form, feeds, encoder.session.run(None, feeds)[0]


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 2e-2)])
def test_the_tensorrt_vision_graph_computes_the_fused_one(glm4v_engine, dtype, tolerance):
    """What a TensorRT vision engine is built from (``tensorrt_vision_graph``: each fused
    MultiHeadAttention written out as MatMul, Softmax, MatMul; in a half type, the linears and the
    attention in it) computes the fused graph's output within the half type's rounding as tensor
    cores compute (``half_rounded``), relative to the output's norm (``benchmarks.vision_half``
    measures it on a screenshot). ONNX Runtime runs the float16 graph itself too."""
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph.vision import MICROSOFT
    from autoglm_trt.graph.vision_trt import HALF, half_rounded

    fused, form, feeds, want = tensorrt_forms(glm4v_engine, dtype)
    assert sum(n.op_type == "MultiHeadAttention" for n in fused.graph.node) == 2
    assert not any(n.domain == MICROSOFT for n in form.graph.node)
    runs = [form] if dtype != "bfloat16" else []
    runs += [half_rounded(form, dtype)] if dtype in HALF else []
    for graph in runs:
        got = make_session(graph.SerializeToString(), external_data_dir=glm4v_engine).run(None, feeds)[0]
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tensorrt_vision_graph_types(glm4v_engine, dtype):
    """The types a strongly typed TensorRT network runs: every MatMul (linears, the attention's two)
    and the Softmax in the half type, every norm's ReduceMean, the residual adds and the GELU in
    float32, inputs and output float32; each attention's query scaled before its first MatMul (the
    pattern TensorRT fuses), and each linear's input cast once (gate and up share one cast, the
    projection after the attention takes the attention's half output)."""
    import onnx

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.graph.vision_trt import HALF

    _, form, _, _ = tensorrt_forms(glm4v_engine, dtype)
    inferred = onnx.shape_inference.infer_shapes(form, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.input,
                                                              *inferred.graph.output]}
    types.update({t.name: t.data_type for t in form.graph.initializer})
    producer = {o: n for n in form.graph.node for o in n.output}
    half, f32 = HALF[dtype], onnx.TensorProto.FLOAT
    by_op: dict[str, list] = {}
    for n in form.graph.node:
        by_op.setdefault(n.op_type, []).append(n)
    assert by_op["MatMul"] and all(types[i] == half for n in by_op["MatMul"] for i in n.input)
    assert all(types[n.input[0]] == half for n in by_op["Softmax"])
    assert all(types[n.input[0]] == f32 for op in ("ReduceMean", "Erf", "Sqrt") for n in by_op[op])
    residuals = [n for n in by_op["Add"] if "residual" in n.output[0]]
    assert residuals and all(types[n.output[0]] == f32 for n in residuals)
    assert {i.name: types[i.name] for i in form.graph.input} == {i.name: f32 for i in form.graph.input}
    assert types["image_embeds"] == f32
    scores = [n for n in by_op["MatMul"] if producer[n.input[0]].op_type == "Mul"]
    assert len(scores) == 2 == len(by_op["Softmax"])
    head_dim = ExportRecord.read(glm4v_engine).vision().head_dim
    for n in scores:
        scale = next(t for t in form.graph.initializer if t.name == producer[n.input[0]].input[1])
        assert onnx.numpy_helper.to_array(scale).astype(np.float32) == np.float32(head_dim ** -0.5)
    to_half = [n for n in by_op["Cast"] if n.attribute[0].i == half]
    assert len({n.input[0] for n in to_half}) == len(to_half)  # one cast a tensor
    assert not any(n.input[0] in producer and producer[n.input[0]].op_type == "Cast" for n in to_half)


def test_build_config_image_limits_are_the_engine_defaults(tiny_dir, tmp_path):
    from conftest import build_tiny_engine

    said: list[str] = []
    engine_dir = build_tiny_engine(tiny_dir, tmp_path / "engine", family="glm4v", max_seq_len=256, log=said.append,
                                   kv_num_blocks=64, max_images=1, max_pixels=2 * 60 * 60, vision_dtype="float16")
    assert ("vision_dtype float16 is for a TensorRT vision engine; ONNX Runtime's encoder runs float32 or INT8 "
            "linears (vision_linears)") in said
    image = random_image(300, 300, 2)
    with Engine.load(engine_dir) as engine:
        assert engine.prepare(image_message(image)).ids.count(IMAGE_TOKEN) == 4  # resized to 56 x 56: 2 x 2 tokens
        with pytest.raises(RequestError, match=r"more than 1 image\(s\)"):
            engine.prepare(image_message(image, image))
    with Engine.load(engine_dir, images=ImageOptions(max_images=2)) as engine:  # the caller's options win
        assert engine.prepare(image_message(image, image)).ids.count(IMAGE_TOKEN) == 8
    doctor = run_cli("doctor", str(engine_dir))
    assert doctor.returncode == 0, doctor.stderr
    assert ("vision encoder: vision.onnx on ONNX Runtime here: float32 linears (the build's vision_linears), "
            "float32 MultiHeadAttention (the build's vision_attention); by default images of "
            "up to 7,200 pixels (18 patches, 4 image tokens), 1 a prompt") in doctor.stdout


def test_reserve_learns_the_embeddings_bytes_before_any_image_is_decoded(glm4v_engine, monkeypatch):
    """``prepare``'s ``reserve`` gets, from the images' headers, exactly the bytes their embeddings
    then take; one that raises refuses the prompt before a pixel is decoded."""
    from autoglm_trt.runtime import images as images_module

    decoded: list[int] = []
    real = images_module.decode_rgb
    monkeypatch.setattr(images_module, "decode_rgb", lambda *a: decoded.append(1) or real(*a))
    asked: list[int] = []
    with Engine.load(glm4v_engine) as engine:
        prepared = engine.prepare(image_message("two ", random_image(64, 96, 3), random_image(90, 40, 4)),
                                  reserve=asked.append)
        assert asked == [sum(e.nbytes for e in prepared.images.embeds)] and asked[0] > 0 and len(decoded) == 2

        def refuse(n: int) -> None:
            raise RequestError(f"no room for {n} bytes")

        with pytest.raises(RequestError, match="no room for"):
            engine.prepare(image_message("one ", random_image(64, 96, 5)), reserve=refuse)
        assert len(decoded) == 2  # nothing more was decoded
        asked.clear()
        engine.prepare("no image here", reserve=asked.append)
        assert asked == []


def test_at_most_a_few_requests_hold_decoded_images_at_once(glm4v_engine, monkeypatch):
    """Six requests prepared at once while the encoder is held: only ``PREPARED_AT_ONCE`` of them
    decode their screenshot (the others wait with it still compressed, so a burst of requests
    does not hold every one decoded and preprocessed), all six count as preparing, and once the
    encoder lets go every request is prepared."""
    import threading
    import time

    from autoglm_trt.runtime import images as pipeline

    def wait_until(condition, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    decoded, lock, release = [0], threading.Lock(), threading.Event()
    real_decode = pipeline.decode_rgb

    def counted(image):
        with lock:
            decoded[0] += 1
        return real_decode(image)

    monkeypatch.setattr(pipeline, "decode_rgb", counted)
    with Engine.load(glm4v_engine) as engine:
        hold_encoder(engine, release)
        got: list = [None] * 6

        def prepare(k: int) -> None:
            got[k] = engine.prepare(image_message("look ", random_image(64, 96, 20 + k)))

        threads = [threading.Thread(target=prepare, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        try:
            assert wait_until(lambda: engine.stats()["images_preparing"] == 6 and decoded[0] == pipeline.PREPARED_AT_ONCE)
            time.sleep(0.3)
            assert decoded[0] == pipeline.PREPARED_AT_ONCE < 6
        finally:
            release.set()
            for t in threads:
                t.join(60)
    assert decoded[0] == 6 and all(g is not None and g.images is not None for g in got)


def test_screenshots_are_encoded_one_at_a_time_and_a_repeated_one_once(glm4v_engine):
    """Four requests prepared at once (two with the same screenshot): the encoder never runs two
    images at once, the repeated screenshot is encoded once (the cache is read again when its turn
    comes), each request's embeddings are what preparing it alone gives, and the engine counts the
    four as preparing while the first is encoded."""
    import threading
    import time

    images = [random_image(100, 160, seed) for seed in (11, 12, 13, 11)]
    with Engine.load(glm4v_engine) as engine:
        want = [engine.prepare(image_message("look ", im)).images.embeds[0] for im in images[:3]]
    with Engine.load(glm4v_engine) as engine:
        real, watch = engine.images.encoder, {"inside": 0, "most": 0, "calls": 0, "preparing": 0}
        lock = threading.Lock()

        class Watched:
            def encode(self, rows, grid):
                with lock:
                    watch["inside"] += 1
                    watch["calls"] += 1
                    watch["most"] = max(watch["most"], watch["inside"])
                time.sleep(0.1)
                watch["preparing"] = max(watch["preparing"], engine.stats()["images_preparing"])
                try:
                    return real.encode(rows, grid)
                finally:
                    with lock:
                        watch["inside"] -= 1

        engine.images.encoder = Watched()
        got: list = [None] * 4
        start = threading.Barrier(4)

        def prepare(k: int) -> None:
            start.wait()
            got[k] = engine.prepare(image_message("look ", images[k]))

        threads = [threading.Thread(target=prepare, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.stats()["images_preparing"] == 0
    assert watch["most"] == 1 and watch["calls"] == 3 and watch["preparing"] == 4
    for k, expected in enumerate(want + [want[0]]):
        np.testing.assert_array_equal(got[k].images.embeds[0], expected)
    assert max(p.seconds["encoder_wait"] for p in got) >= 0.1


def _spins(engine: Engine) -> str:
    return engine.backend.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("spinning", [True, False])
def test_the_decoder_threads_spin_or_block_as_asked(glm4v_engine, tiny_engine, spinning):
    """``spinning`` sets the decoder's ONNX Runtime threads (an image engine's and a text engine's);
    the vision encoder's spin either way."""
    with Engine.load(glm4v_engine, spinning=spinning) as engine:
        assert _spins(engine) == str(int(spinning))
        encoder = engine.images.encoder.session.get_session_options()
        assert encoder.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    with Engine.load(tiny_engine, spinning=spinning) as engine:
        assert _spins(engine) == str(int(spinning))
    with Engine.load(tiny_engine) as engine:
        assert _spins(engine) == "1"


def test_the_export_records_its_image_parity(glm4v_engine):
    from autoglm_trt.artifacts import ExportRecord

    record = ExportRecord.read(glm4v_engine)
    report = record.data["parity"]["images"]
    assert report["passed"] and report["chunked"]["argmax_agree"] == report["prompt_tokens"]
    assert record.vision() is not None and all(f.is_file() for f in record.vision_files())


def test_images_survive_preemption_and_forks(tiny_dir, tmp_path):
    """A pool too small for four image prompts at once preempts and later recomputes some (their
    image rows come again from the sequence), and n=3 samples fork after the prompt: every answer
    equals the same request run alone on a roomy engine."""
    from conftest import build_tiny_engine

    small = build_tiny_engine(tiny_dir, tmp_path / "small", family="glm4v", max_seq_len=128, max_input_len=24,
                              kv_num_blocks=16, max_batch_size=4)
    prompts = [image_message(f"screen {k}: ", random_image(150 + 20 * k, 120, 10 + k), " act") for k in range(4)]
    greedy = SamplingParams(max_new_tokens=48, ignore_eos=True)
    with Engine.load(small, prefix_caching=False) as engine:
        together = engine.generate(prompts, greedy)
        preempted = engine.stats()["preemptions"]
        [forked] = engine.generate([prompts[0]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, n=3))
    with Engine.load(small, prefix_caching=False) as engine:
        alone = [engine.generate([p], greedy)[0] for p in prompts]
        [single] = engine.generate([prompts[0]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, n=3))
    assert preempted > 0
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [c.token_ids for c in forked.choices] == [c.token_ids for c in single.choices]


def test_an_int8_build_calibrates_with_images_and_answers_them(tiny_dir, tmp_path):
    """``build --precision int8`` on GLM-4.1V: the calibration takes image windows (synthetic
    screenshots: the shipped calibration folder holds text), the engine keeps the float encoder, adds
    its INT8-linear and bfloat16-attention forms (``vision_linears`` and ``vision_attention`` auto: an
    8-bit decoder gets them) and answers image prompts."""
    import json

    from conftest import build_tiny_engine

    engine_dir = build_tiny_engine(tiny_dir, tmp_path / "int8", family="glm4v", precision="int8", max_seq_len=256,
                                   kv_num_blocks=64)
    record = json.loads((engine_dir / "calib.json").read_text())
    assert record["data"]["image_windows"] == 4 and (engine_dir / "vision.onnx").is_file()
    built = json.loads((engine_dir / "manifest.json").read_text())["vision"]
    assert (built["linears"], built["attention"]) == ("int8", "bfloat16")
    with Engine.load(engine_dir) as engine:
        [res] = engine.generate([image_message("what is on the screen? ", random_image(120, 200, 3))],
                                SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(res.token_ids) == 6 and res.prompt_tokens > 20


def test_an_int8_wo_build_keeps_the_float_encoder_and_answers_image_prompts(tiny_dir, tmp_path):
    """``build --precision int8-wo`` on GLM-4.1V: the decoder's weights INT8, the vision encoder as
    exported, and an image prompt's greedy answer (the image changes it) with the fp32 engine's first
    token (the tiny random model's top two logits are far apart there)."""
    from conftest import build_tiny_engine

    wo = build_tiny_engine(tiny_dir, tmp_path / "wo", family="glm4v", precision="int8-wo", max_seq_len=256,
                           kv_num_blocks=64)
    fp32 = build_tiny_engine(tiny_dir, tmp_path / "fp32", family="glm4v", max_seq_len=256, kv_num_blocks=64)
    assert (wo / "vision.onnx").is_file() and not (wo / "calib.json").exists()
    prompts = [image_message("what is on the screen? ", random_image(120, 200, seed)) for seed in (3, 4)]
    answers = {}
    for name, path in (("wo", wo), ("fp32", fp32)):
        with Engine.load(path) as engine:
            answers[name] = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(r.token_ids) == 6 and r.prompt_tokens > 20 for r in answers["wo"])
    assert answers["wo"][0].token_ids[0] == answers["fp32"][0].token_ids[0]
    assert answers["fp32"][0].token_ids != answers["fp32"][1].token_ids  # the answers read the image


def test_an_int4_awq_build_searches_its_scales_on_image_windows_too(tiny_dir, tmp_path):
    """``build --precision int4-awq`` on GLM-4.1V: the AWQ search's rows include one window per
    calibration image (the synthetic screenshots), GPTQ's Gram matrices those and more text
    windows, the engine keeps the float encoder, and its answers read the image. Built with a
    loose accuracy gate, which runs its switchable graph on GLM-4.1V's decoder and passes at once."""
    import json

    from conftest import build_tiny_engine

    engine_dir = build_tiny_engine(tiny_dir, tmp_path / "int4", family="glm4v", precision="int4-awq", max_seq_len=256,
                                   kv_num_blocks=64, int4_gate=2.0)
    [record] = [json.loads(p.read_text()) for p in (tmp_path / ".cache").glob("*/int4-awq/export.json")]
    assert len(record["int4"]["images_sha256"]) == 4 and (engine_dir / "vision.onnx").is_file()
    assert record["int4"]["rounding"].startswith("GPTQ") and record["int4"]["gram_data_sha256"]
    assert record["int4"]["gate"]["result"]["passed"] and record["int4"]["int8_linears"] == []
    prompts = [image_message("what is on the screen? ", random_image(120, 200, seed)) for seed in (3, 4)]
    with Engine.load(engine_dir) as engine:
        answers = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(r.token_ids) == 6 and r.prompt_tokens > 20 for r in answers)
    assert answers[0].token_ids != answers[1].token_ids


MARGIN = 0.1  # nats


@pytest.mark.parametrize("linears,attention", [("int8", "float32"), ("float32", "bfloat16"), ("int8", "bfloat16")])
def test_fast_vision_forms_keep_the_image_tokens_and_the_answers(glm4v_engine, tiny_dir, tmp_path, monkeypatch,
                                                                 linears, attention):
    """``vision_linears: int8`` and ``vision_attention: bfloat16``: the encoder's INT8 form and each
    graph's native-attention form beside the float one, each run where this CPU can (INT8 where it
    sums bytes exactly, the native attention where it has AVX512-BF16); per image token a cosine of
    at least 0.999 with the float32 encoder's embedding, and greedy answers to image prompts equal
    the float encoder's engine's wherever that engine is sure of its token (its top two
    log-probabilities ``MARGIN`` apart: the tiny random model also hesitates between two tokens by
    less, which any rounding may flip). ``AUTOGLM_TRT_VISION_INT8=0`` with ``AUTOGLM_TRT_NATIVE=0``
    runs the float32 graph."""
    from conftest import build_tiny_engine

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.vision import vision_graph
    from autoglm_trt.native import image_attention_bf16, int8_pairs_saturate
    from autoglm_trt.native import library as native_library

    engine_dir = build_tiny_engine(tiny_dir, tmp_path / "fast-vision", family="glm4v", max_input_len=24,
                                   max_seq_len=256, kv_num_blocks=160, vision_linears=linears,
                                   vision_attention=attention)
    built = Manifest.read(engine_dir).data["vision"]
    assert (built["linears"], built["attention"]) == (linears, attention)
    assert built["graphs"] == {"float32": "vision.onnx", **({"int8": "vision.int8.onnx"} if linears == "int8" else {})}
    if linears == "int8":  # per block qkv, proj, gate, up, down; the patch embedding, the downsample and the merger's
        assert built["int8_linears"] == 2 * 5 + 6
    assert built.get("native_graphs") == ({k: v.replace(".onnx", ".native.onnx") for k, v in built["graphs"].items()}
                                          if attention == "bfloat16" else None)
    assert Manifest.read(glm4v_engine).data["vision"] == {"linears": "float32", "attention": "float32",
                                                          "graphs": {"float32": "vision.onnx"}}
    library = native_library()[0]
    int8_here = linears == "int8" and not int8_pairs_saturate()
    native_here = attention == "bfloat16" and library is not None and image_attention_bf16(library)
    want = ("vision.int8" if int8_here else "vision") + (".native" if native_here else "") + ".onnx"
    assert vision_graph(Manifest.read(engine_dir))[0] == want
    images = [random_image(181, 250, 1), random_image(151, 109, 2), random_image(300, 90, 4)]
    prompts = [image_message("look: ", images[0], " what is it?"), image_message("compare ", images[1], " with ",
                                                                                    images[2], ".")]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2)
    embeddings, answers, margins = {}, {}, []
    for name, path in (("float", glm4v_engine), ("fast", engine_dir)):
        with Engine.load(path, prefix_caching=False) as engine:
            pipeline = engine.images
            assert pipeline.encoder.graph == (want if name == "fast" else "vision.onnx")
            embeddings[name] = [pipeline.encoder.encode(*_rows_and_grid(pipeline, image)) for image in images]
            results = engine.generate(prompts, params)
            answers[name] = [r.token_ids for r in results]
            if name == "float":
                margins = [[t.top[0][1] - t.top[1][1] for t in r.choices[0].logprobs] for r in results]
    if want == "vision.onnx":
        pytest.skip("this CPU runs neither form here (no VNNI or no AVX512-BF16): the float32 encoder ran (checked)")
    for ours, theirs in zip(embeddings["fast"], embeddings["float"]):
        cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
        assert cosine.min() >= 0.999 and not np.array_equal(ours, theirs)
    sure = [next((i for i, m in enumerate(ms) if m < MARGIN), len(ms)) for ms in margins]
    assert min(sure) >= 1, sure
    assert [a[:n] for a, n in zip(answers["fast"], sure)] == [a[:n] for a, n in zip(answers["float"], sure)]
    monkeypatch.setenv("AUTOGLM_TRT_VISION_INT8", "0")
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    with Engine.load(engine_dir, prefix_caching=False) as engine:
        assert engine.images.encoder.graph == "vision.onnx"
        np.testing.assert_array_equal(engine.images.encoder.encode(*_rows_and_grid(engine.images, images[0])),
                                      embeddings["float"][0])


def _rows_and_grid(pipeline, image):
    from autoglm_trt.model.image import preprocess

    pixels, grids = preprocess([image], pipeline.config)
    return pixels, tuple(int(v) for v in grids[0])
