"""A model repository for an engine, served by a real tritonserver (2.51, CPU, from PyPI's
nvidia-pytriton wheel; ``make triton`` installs it) on loopback ports started by the test."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import ROOT, free_port

from autoglm_trt.errors import AutoGLMError
from autoglm_trt.runtime import Engine, SamplingParams
from autoglm_trt.triton.launcher import find_tritonserver, stop

try:
    find_tritonserver()
    HAVE_TRITON = True
except AutoGLMError:
    HAVE_TRITON = False
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="no tritonserver: `make triton` installs one (make test does)")


def post(port: int, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream_text(port: int, body: dict) -> str:
    status, text = post(port, "/v2/models/tiny-chat/generate_stream", {**body, "stream": True})
    assert status == 200, text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert not any("error" in e for e in events), events
    return "".join(e.get("text_output", "") for e in events)


@pytest.fixture(scope="module")
def triton(chat_engine, tmp_path_factory):
    with triton_server(chat_engine, tmp_path_factory.mktemp("triton") / "repo", instances=2) as served:
        yield served


@contextlib.contextmanager
def triton_server(engine, repo, instances: int = 1):
    """``autoglm-trt triton`` then ``triton-serve`` on free ports; always stopped, no process left."""
    r = subprocess.run([sys.executable, "-m", "autoglm_trt", "triton", str(engine), "-o", str(repo),
                        "--instances", str(instances)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "triton-serve", str(repo), "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--ready-timeout", "180"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if get(http, "/v2/health/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        assert proc.poll() is None, proc.stderr.read()
        yield {"http": http, "metrics": metrics, "proc": proc, "repo": repo}
    finally:
        stop(proc, 90)
        leftover = subprocess.run(["pgrep", "-f", str(repo)], capture_output=True, text=True).stdout.strip()
        if leftover:
            subprocess.run(["pkill", "-9", "-f", str(repo)])
        assert not leftover, f"tritonserver processes left behind: {leftover}"


def test_generate_matches_the_engine_and_streams_join(triton, chat_engine):
    prompts = ["Once upon a time", "The capital of France is", "abc", "def fib(n):", "x y z", "Hello there"]
    with Engine.load(chat_engine) as engine:
        expected = [r.text for r in engine.generate(prompts, SamplingParams(max_new_tokens=12))]
    port = triton["http"]
    status, text = post(port, "/v2/models/tiny-chat/generate", {"text_input": prompts[0], "max_tokens": 12})
    assert status == 200 and json.loads(text)["text_output"] == expected[0]
    assert stream_text(port, {"text_input": prompts[0], "max_tokens": 12}) == expected[0]
    got: dict[int, str] = {}

    def one(i: int) -> None:
        got[i] = stream_text(port, {"text_input": prompts[i], "max_tokens": 12})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(prompts))] == expected  # concurrent streams do not mix


def test_images_beside_the_text(glm4v_engine, tmp_path):
    """A GLM-4.1V engine's model: ``text_input`` with the image placeholders, ``images`` as data: URLs
    (what /generate's JSON can carry), the same answer as the engine; a bad image is an error."""
    from conftest import data_url, random_image

    shot = random_image(108, 240, 4)
    text = "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>Tap the button.<|assistant|>\n"
    with Engine.load(glm4v_engine) as engine:
        want = engine.generate([engine.prepare(text, images=[shot])], SamplingParams(max_new_tokens=6,
                                                                                      temperature=0.0))[0]
    with triton_server(glm4v_engine, tmp_path / "repo") as served:
        port = served["http"]
        body = {"text_input": text, "images": [data_url(shot)], "max_tokens": 6}
        status, got = post(port, "/v2/models/tiny-glm4v/generate", body)
        assert status == 200 and json.loads(got)["text_output"] == want.text, got
        status, got = post(port, "/v2/models/tiny-glm4v/generate", {**body, "images": ["data:image/png;base64,aGk="]})
        assert status >= 400 and "not an image" in got
        status, got = post(port, "/v2/models/tiny-glm4v/generate", {**body, "images": []})
        assert status >= 400 and "placeholder" in got


def test_penalties_as_tensorrt_llm_names_them(triton, chat_engine):
    knobs = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 3}
    with Engine.load(chat_engine) as engine:
        [want] = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=12, **knobs))
        [plain] = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=12))
    assert want.text != plain.text  # the knobs act on this prompt
    status, text = post(triton["http"], "/v2/models/tiny-chat/generate",
                        {"text_input": "Once upon a time", "max_tokens": 12, **knobs})
    assert status == 200 and json.loads(text)["text_output"] == want.text
    status, text = post(triton["http"], "/v2/models/tiny-chat/generate",
                        {"text_input": "hi", "max_tokens": 3, "frequency_penalty": 9.0})
    assert status >= 400 and "frequency_penalty" in text


def test_log_probs_and_guided_decoding_as_tensorrt_llm_names_them(triton, chat_engine):
    with Engine.load(chat_engine) as engine:
        [want] = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=6, logprobs=0))
    status, text = post(triton["http"], "/v2/models/tiny-chat/generate",
                        {"text_input": "Once upon a time", "max_tokens": 6, "return_log_probs": True})
    got = json.loads(text)
    assert status == 200 and got["output_log_probs"] == pytest.approx([e.logprob for e in want.choices[0].logprobs],
                                                                      abs=1e-5)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    status, text = post(triton["http"], "/v2/models/tiny-chat/generate",
                        {"text_input": "Once upon a time", "max_tokens": 30, "temperature": 1.0, "random_seed": 3,
                         "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(schema)})
    assert status == 200 and 0 <= json.loads(json.loads(text)["text_output"])["n"] <= 99
    status, text = post(triton["http"], "/v2/models/tiny-chat/generate",
                        {"text_input": "hi", "max_tokens": 3, "guided_decoding_guide_type": "yaml"})
    assert status >= 400 and "guided_decoding_guide_type" in text


def test_bad_inputs_are_triton_errors_and_the_model_stays_up(triton):
    port = triton["http"]
    status, text = post(port, "/v2/models/tiny-chat/generate", {"max_tokens": 4})
    assert status >= 400 and "text_input is required" in text
    status, text = post(port, "/v2/models/tiny-chat/generate", {"text_input": "hi", "max_tokens": 5000})
    assert status >= 400 and "max_seq_len" in text
    status, text = post(port, "/v2/models/tiny-chat/generate", {"text_input": "hi", "max_tokens": 3, "top_p": 7.0})
    assert status >= 400 and "top_p" in text
    assert get(port, "/v2/health/ready")[0] == 200
    status, text = post(port, "/v2/models/tiny-chat/generate", {"text_input": "hi", "max_tokens": 3})
    assert status == 200 and "text_output" in json.loads(text)


def test_metrics_show_triton_and_engine_gauges(triton):
    post(triton["http"], "/v2/models/tiny-chat/generate", {"text_input": "metrics", "max_tokens": 2})
    time.sleep(0.6)  # the engine gauges are published every 0.25 s
    _, text = get(triton["metrics"], "/metrics")
    assert 'nv_inference_count{model="tiny-chat"' in text
    blocks = [line for line in text.splitlines() if line.startswith("autoglm_kv_blocks_total")]
    assert len(blocks) == 2 and all(line.endswith(" 64") for line in blocks)  # one per instance
    assert "autoglm_requests_waiting" in text and "autoglm_kv_blocks_used" in text


def test_repository_refuses_a_corrupt_engine(chat_engine, tmp_path):
    import shutil

    broken = tmp_path / "engine"
    shutil.copytree(chat_engine, broken)
    (broken / "tokenizer.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "autoglm_trt", "triton", str(broken), "-o", str(tmp_path / "repo")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "tokenizer.json is corrupt" in r.stderr and not (tmp_path / "repo").exists()


def test_repository_holds_only_the_manifests_files_and_refuses_links(chat_engine, tmp_path):
    """Copying the whole engine directory following links would bring in a linked file's content
    from outside, a linked directory's files too, and recurse forever on a link loop."""
    import shutil

    from autoglm_trt.errors import AutoGLMError
    from autoglm_trt.triton.repository import write_repository

    engine = tmp_path / "engine"
    shutil.copytree(chat_engine, engine)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_rsa").write_text("PRIVATE")
    (engine / "notes.txt").write_text("not the engine's")
    (engine / "keys").symlink_to(secret, target_is_directory=True)
    (engine / "loop").symlink_to(engine, target_is_directory=True)
    model = write_repository(engine, tmp_path / "repo")
    copied = sorted(p.name for p in (model / "1" / "engine").iterdir())
    assert copied == sorted(["manifest.json", *json.loads((engine / "manifest.json").read_text())["files"]])
    assert not any(p.is_symlink() for p in (model / "1" / "engine").iterdir())

    for target in (chat_engine / "tokenizer.json", engine / "tokenizer.real"):  # same bytes, outside and inside
        if not (engine / "tokenizer.real").exists():
            (engine / "tokenizer.json").rename(engine / "tokenizer.real")
        (engine / "tokenizer.json").unlink(missing_ok=True)
        (engine / "tokenizer.json").symlink_to(target)
        with pytest.raises(AutoGLMError, match="symbolic link"):
            write_repository(engine, tmp_path / "repo2")
        assert not (tmp_path / "repo2").exists()


def test_text_that_is_not_utf8_is_an_error_and_the_model_stays_up(triton):
    """A decoding error outside the model's error handling would leave the request without an answer."""
    port = triton["http"]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/tiny-chat/generate",
                                 b'{"text_input": "a \xff\xfe b", "max_tokens": 3}', {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:  # the bytes reach the model, whose answer says why
        urllib.request.urlopen(req, timeout=120)
    assert "text_input is not valid UTF-8" in err.value.read().decode(errors="replace")
    status, text = post(port, "/v2/models/tiny-chat/generate", {"text_input": "hi", "max_tokens": 3})
    assert status == 200 and "text_output" in json.loads(text)
