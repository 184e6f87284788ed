"""Every native operator under random and extreme inputs (``fuzz_driver.py``), in a process of its
own: with the installed library, and with a build under AddressSanitizer and UBSan, under which
the other native tests run once too, as they do under a Clang build. A crash, a hang, a
sanitizer's report or an error that does not name its operator fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
SANITIZERS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
# the tests of the operators' arithmetic, run again against the sanitizer build
OPERATOR_TESTS = ("test_native_attention.py", "test_int8_linear.py", "test_float_linear.py", "test_rope_op.py",
                  "test_masked_softmax.py", "test_constant_inputs.py", "test_int8_weight_linear.py", "test_block_linear.py",
                  "test_prefill_attention.py", "test_image_attention.py")


def fuzz(library: Path, cases: int, seed: int, env: dict[str, str] | None = None) -> dict[str, tuple[int, int]]:
    """Runs the driver; each operator's (ran, refused), after checking the run ended well."""
    done = subprocess.run([sys.executable, str(HERE / "fuzz_driver.py"), str(library), "--cases", str(cases),
                           "--seed", str(seed)], capture_output=True, text=True, timeout=900, env=env)
    lines = (done.stdout + done.stderr).splitlines()
    problems = [line for line in lines if not re.match(r"\w+ case \d+: |RESULT ", line)]
    assert done.returncode == 0 and not problems, (
        f"exit {done.returncode}; last case: {next((x for x in reversed(lines) if ' case ' in x), '-')}\n"
        + "\n".join(problems[:40]))
    results = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"RESULT (\w+): (\d+) ran, (\d+) refused", done.stdout)}
    assert len(results) == 29, results
    no_fma = "RESULT fma: 0" in done.stdout
    absent = {"MaskedSoftmax": "RESULT softmax exact: 0" in done.stdout, "PrefillAttention": no_fma,
              "PrefillAttentionBf16": no_fma, "ImageAttentionBf16": "RESULT image attention: 0" in done.stdout}
    for op, (ran, refused) in results.items():  # the cases reach the kernels, and the checks
        if absent.get(op):  # a build without AVX-512F (MaskedSoftmax), FMA (PrefillAttention) or a CPU without
            # AVX512-BF16 (ImageAttentionBf16): refused by name
            assert ran == 0 and refused == cases, (op, ran, refused)
            continue
        # QuantizeKVRows takes any float tensor of rank 1 to 8 (the mutations rarely leave that)
        assert ran >= cases // 4 and (refused >= cases // 10 or op == "QuantizeKVRows"), (op, ran, refused)
    return results


def test_every_operator_computes_or_refuses_by_name(library):
    fuzz(library, 300, seed=7)


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The best build for this CPU compiled with AddressSanitizer and UBSan, and the environment
    that loads it into Python (the sanitizer runtime first, and libstdc++ so that its interception
    of C++ exceptions finds them)."""
    from autoglm_trt.native import library as native_library
    from autoglm_trt.native import variant_of
    from autoglm_trt.native.build import compile_library, compiler
    from autoglm_trt.native.variants import COMMON_FLAGS, SOURCES, for_machine

    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler for the sanitizer build")
    runtime = [subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
               for name in ("libasan.so", "libstdc++.so")]
    if not all(os.path.isabs(path) and os.path.exists(path) for path in runtime):
        pytest.skip(f"{cc} has no AddressSanitizer runtime (libasan) here")
    best, why = native_library()
    variants = {v.name: v for v in for_machine()}
    variant = variants.get(variant_of(best)) if best is not None else variants["generic"]
    out = tmp_path_factory.mktemp("asan") / "libautoglm-asan.so"
    compile_library(out, variant.flags, SOURCES, COMMON_FLAGS, extra=SANITIZERS, cc=cc)
    env = {**os.environ, "LD_PRELOAD": " ".join(runtime), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
           "UBSAN_OPTIONS": "print_stacktrace=1", "AUTOGLM_TRT_TEST_LIBRARY": str(out)}
    return out, env


def test_no_sanitizer_report_under_fuzzing(sanitized):
    out, env = sanitized
    fuzz(out, 400, seed=11, env=env)


def operator_tests(env: dict[str, str]) -> str:
    """The arithmetic tests of the operators in a process of its own, against the library that
    ``$AUTOGLM_TRT_TEST_LIBRARY`` names in ``env`` (``library`` and ``kernel_library`` give it);
    their output, once they passed."""
    # -s: a sanitizer's report goes out as it is written (the process ends before pytest would show it)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
                           "-k", "not doctor and not compiled_loop",  # those compare the installed library with others
                           *(str(HERE / name) for name in OPERATOR_TESTS)],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0 and re.search(r"\d+ passed", done.stdout), tail
    return done.stdout + done.stderr


def test_operator_tests_pass_under_sanitizers(sanitized):
    _, env = sanitized
    out = operator_tests(env)
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-4000:]


@pytest.mark.skipif(shutil.which("clang") is None, reason="no clang on PATH (apt-get install clang; .ci/run installs it)")
def test_every_build_compiles_with_clang_and_the_best_passes_the_operator_tests(tmp_path):
    """The library is C11 that GCC and Clang both compile, to the same sums: every build of this
    CPU with Clang, and the operators' arithmetic tests against the best of them."""
    from autoglm_trt.native import library as native_library
    from autoglm_trt.native import variant_of
    from autoglm_trt.native.build import compile_library
    from autoglm_trt.native.variants import COMMON_FLAGS, SOURCES, for_machine

    built = {}
    for variant in for_machine():
        built[variant.name] = tmp_path / f"libautoglm-{variant.name}.so"
        compile_library(built[variant.name], variant.flags, SOURCES, COMMON_FLAGS, cc="clang")
    best, _ = native_library()
    operator_tests({**os.environ, "AUTOGLM_TRT_TEST_LIBRARY": str(built[variant_of(best) if best else "generic"])})
