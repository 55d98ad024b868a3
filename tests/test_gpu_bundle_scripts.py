"""The vLLM bundle of the GPU runs (tests/gpu/bundle/): both scripts parse, the GPU suite's README
names no path outside the repository, and device_setup.sh joins the pieces of a split part, refusing
the second piece, with its one-line message, where the first was not kept by an earlier call. Small
made-up archives in temporary folders (VSITE, VPARTS); no network, no GPU."""

import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "tests" / "gpu" / "bundle"
SCRIPTS = [BUNDLE / "make_bundle.sh", BUNDLE / "device_setup.sh", ROOT / "tests" / "gpu" / "release_bench.sh"]

needs_xz = pytest.mark.skipif(shutil.which("xz") is None, reason="device_setup.sh unpacks with xz")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_gpu_readme_names_no_path_outside_the_repository():
    readme = (ROOT / "tests" / "gpu" / "README.md").read_text()
    assert "../shared" not in readme
    assert "tests/gpu/bundle/make_bundle.sh" in readme


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue())


def _wheel(folder: Path, name: str) -> None:
    """A minimal wheel of one module, NAME, that pip installs from the file alone."""
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}.py", "X = 1\n")
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


def _part(bundle: Path, part: str, files: dict[str, bytes]) -> None:
    """A part of a made-up bundle: its files and the copy of device_setup.sh every part holds."""
    (bundle / part).mkdir(parents=True)
    for name, data in files.items():
        (bundle / part / name).parent.mkdir(parents=True, exist_ok=True)
        (bundle / part / name).write_bytes(data)
    shutil.copy(BUNDLE / "device_setup.sh", bundle / part)


def _run(tmp_path: Path, bundle: Path, part: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VSITE": str(tmp_path / "vsite"), "VPARTS": str(tmp_path / "parts"), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(bundle / part / "device_setup.sh"), part, str(bundle)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _refused(proc: subprocess.CompletedProcess[str], message: str) -> None:
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@needs_xz
def test_part1b_refused_without_part1a(tmp_path):
    bundle = tmp_path / "bundle"
    _part(bundle, "part1b", {"vllm_C.tar.xz.01": b"second half"})
    _refused(_run(tmp_path, bundle, "part1b"), "NEED PART1A first")
    assert not (tmp_path / "vsite" / "vllm").exists()


@needs_xz
def test_part2b_refused_without_part2a(tmp_path):
    bundle = tmp_path / "bundle"
    _part(bundle, "part2b", {})
    (bundle / "part2b" / "whl").mkdir()
    _wheel(bundle / "part2b" / "whl", "tinydep")
    _refused(_run(tmp_path, bundle, "part2b"), "NEED PART2A first")
    assert not (tmp_path / "vsite" / "tinydep.py").exists()


@needs_xz
def test_split_parts_unpack_in_order(tmp_path):
    """part1a, part1b, part2a, part2b: the site folder gets what part1 and part2 would give."""
    bundle = tmp_path / "bundle"
    so = os.urandom(4096)
    c = _tar_xz({"vllm/_C_stable_libtorch.abi3.so": so})
    _part(bundle, "part1a", {"vllm_C.tar.xz.00": c[: len(c) // 2]})
    _part(bundle, "part1b", {"vllm_C.tar.xz.01": c[len(c) // 2 :]})
    py = _tar_xz({"vllm/__init__.py": b"", "vllm-0.0.dist-info/METADATA": b"Name: vllm\n"})
    fa3 = _tar_xz({"vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3"})
    _part(bundle, "part2a", {"vllm_py.tar.xz": py, "vllm_fa3.tar.xz": fa3})
    _part(bundle, "part2b", {})
    (bundle / "part2b" / "whl").mkdir()
    _wheel(bundle / "part2b" / "whl", "tinydep")

    # part2 pieces before part1: the archives are kept, but part2b needs part1 in the site
    assert _run(tmp_path, bundle, "part2a").returncode == 0
    _refused(_run(tmp_path, bundle, "part2b"), "NEED PART1 first")
    for part in ("part1a", "part1b", "part2b"):
        proc = _run(tmp_path, bundle, part)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "vsite"
    assert (site / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == so
    assert (site / "vllm" / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").read_bytes() == b"fa3"
    assert (site / "vllm-0.0.dist-info" / "METADATA").exists()
    assert (site / "tinydep.py").read_text() == "X = 1\n"


@needs_xz
def test_pieces_of_two_bundles_are_not_joined(tmp_path):
    one, two = tmp_path / "vllm032", tmp_path / "vllm033"
    _part(one, "part1a", {"vllm_C.tar.xz.00": b"first half"})
    _part(two, "part1b", {"vllm_C.tar.xz.01": b"second half"})
    assert _run(tmp_path, one, "part1a").returncode == 0
    _refused(_run(tmp_path, two, "part1b"), f"is from {one}, not {two}")


def _fa2_pieces(bundle: Path, data: bytes, n: int = 3) -> None:
    """part4a.. of a made-up bundle: FlashAttention-2's archive cut in n pieces, each with the count."""
    archive = _tar_xz({"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": data})
    cut = [len(archive) * i // n for i in range(n + 1)]
    for i in range(n):
        _part(
            bundle,
            f"part4{'abcdefgh'[i]}",
            {f"vllm_fa2.tar.xz.{i:02d}": archive[cut[i] : cut[i + 1]], "pieces": b"%d\n" % n},
        )


@needs_xz
def test_flash_attention_2_pieces_join_on_the_last_call_in_place_of_fa3(tmp_path):
    """A release whose FlashAttention-3 extension links torch's unstable ABI (0.27.x): part2 has no
    vllm_fa3.tar.xz, and part4a, part4b, part4c bring FlashAttention-2, unpacked by the last one."""
    bundle = tmp_path / "bundle"
    so = os.urandom(4096)
    _part(bundle, "part1", {"vllm_C.tar.xz": _tar_xz({"vllm/_C_stable_libtorch.abi3.so": so})})
    py = _tar_xz({"vllm/__init__.py": b"", "vllm-0.0.dist-info/METADATA": b"Name: vllm\n"})
    _part(bundle, "part2a", {"vllm_py.tar.xz": py})
    _part(bundle, "part2b", {})
    (bundle / "part2b" / "whl").mkdir()
    _wheel(bundle / "part2b" / "whl", "tinydep")
    fa2 = os.urandom(8192)
    _fa2_pieces(bundle, fa2)
    site = tmp_path / "vsite"
    for part in ("part1", "part2a", "part2b", "part4a", "part4b"):
        proc = _run(tmp_path, bundle, part)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (site / "vllm" / "vllm_flash_attn").exists()  # not yet: one piece to go
    proc = _run(tmp_path, bundle, "part4c")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so").read_bytes() == fa2
    assert not (site / "vllm" / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").exists()
    assert not (tmp_path / "parts" / "vpart4").exists()  # the pieces go once joined


@needs_xz
def test_part2_carried_whole_needs_no_flash_attention_3_where_part4_brings_2(tmp_path):
    bundle = tmp_path / "bundle"
    _part(bundle, "part1", {"vllm_C.tar.xz": _tar_xz({"vllm/_C_stable_libtorch.abi3.so": b"c"})})
    py = _tar_xz({"vllm/__init__.py": b"", "vllm-0.0.dist-info/METADATA": b"Name: vllm\n"})
    _part(bundle, "part2", {"vllm_py.tar.xz": py})
    (bundle / "part2" / "whl").mkdir()
    _wheel(bundle / "part2" / "whl", "tinydep")
    _fa2_pieces(bundle, b"fa2", n=2)
    for part in ("part1", "part2", "part4a", "part4b"):
        proc = _run(tmp_path, bundle, part)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "vsite" / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so").read_bytes() == b"fa2"
    assert (tmp_path / "vsite" / "tinydep.py").exists()


@needs_xz
def test_a_flash_attention_2_piece_is_refused_out_of_order_or_from_another_bundle(tmp_path):
    one, two = tmp_path / "vllm027", tmp_path / "vllm0271"
    _fa2_pieces(one, b"x" * 512)
    _fa2_pieces(two, b"y" * 512)
    _refused(_run(tmp_path, one, "part4b"), "NEED PART4A first")
    assert _run(tmp_path, one, "part4a").returncode == 0
    _refused(_run(tmp_path, one, "part4c"), "NEED PART4B first")
    _refused(_run(tmp_path, two, "part4b"), f"are from {one}, not {two}")
    assert not (tmp_path / "vsite" / "vllm").exists()


def test_make_bundle_refuses_a_folder_every_call_would_carry():
    """A bundle inside the checkout that git does not ignore would travel with every device call."""
    out = ROOT / "tests" / "gpu" / "bundle" / "not-ignored"
    proc = subprocess.run(
        ["bash", str(BUNDLE / "make_bundle.sh"), str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not git-ignored" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [(["soon"], "WAIT_SECONDS"), (["10", "--alone"], "--together"), (["-5"], "WAIT_SECONDS")],
)
def test_release_bench_refuses_bad_arguments_in_one_line_before_it_stages(tmp_path, args, named):
    bundle = tmp_path / f"vllm-made-up-{os.getpid()}-args"
    _part(bundle, "part1a", {"vllm_C.tar.xz.00": b"x"})
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "release_bench.sh"), str(bundle), *args],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout
    assert not Path(f"/tmp/vstage-{bundle.name}").exists()


@pytest.mark.parametrize("split", [False, True], ids=["part1-whole", "part1a-part1b"])
def test_release_bench_stages_part1_whole_or_in_pieces(tmp_path, split):
    bundle = tmp_path / f"vllm-made-up-{os.getpid()}-{int(split)}"
    if split:
        _part(bundle, "part1a", {"vllm_C.tar.xz.00": b"a"})
        _part(bundle, "part1b", {"vllm_C.tar.xz.01": b"b"})
        kept = ["vllm_C.tar.xz.00", "vllm_C.tar.xz.01"]
    else:
        _part(bundle, "part1", {"vllm_C.tar.xz": b"whole"})
        kept = ["vllm_C.tar.xz"]
    stage = Path(f"/tmp/vstage-{bundle.name}")
    try:
        proc = subprocess.run(
            ["bash", str(ROOT / "tests" / "gpu" / "release_bench.sh"), "stage", str(bundle)],
            capture_output=True, text=True, timeout=30, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in stage.glob("vllm_C*")) == kept
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _release_bench(tmp_path, *args):
    return subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu" / "release_bench.sh"), *args],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip


def test_release_bench_stages_one_form_of_part1_at_a_time(tmp_path):
    """A part1 carried whole after its pieces (or the pieces after it) replaces what was staged: the
    switch would otherwise unpack the stale form."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    name = f"vllm-made-up-{os.getpid()}-forms"
    _part(whole / name, "part1", {"vllm_C.tar.xz": b"whole"})
    _part(split / name, "part1a", {"vllm_C.tar.xz.00": b"a"})
    _part(split / name, "part1b", {"vllm_C.tar.xz.01": b"b"})
    stage = Path(f"/tmp/vstage-{name}")
    try:
        assert _release_bench(tmp_path, "stage", str(split / name)).returncode == 0
        assert _release_bench(tmp_path, "stage", str(whole / name)).returncode == 0
        assert sorted(p.name for p in stage.glob("vllm_C*")) == ["vllm_C.tar.xz"]
        assert _release_bench(tmp_path, "stage", str(split / name)).returncode == 0
        assert sorted(p.name for p in stage.glob("vllm_C*")) == ["vllm_C.tar.xz.00", "vllm_C.tar.xz.01"]
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@pytest.mark.skipif(Path("/tmp/vsite").exists(), reason="a GPU machine's /tmp/vsite is not touched")
def test_release_bench_run_without_part1_staged_says_what_it_needs(tmp_path):
    bundle = tmp_path / f"vllm-made-up-{os.getpid()}-need"
    _part(bundle, "part2", {"vllm_py.tar.xz": b"x"})
    try:
        proc = _release_bench(tmp_path, str(bundle), "5")
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("NEED part1 (or part1a and part1b)")
        assert not Path("/tmp/vsite").exists()
    finally:
        shutil.rmtree(f"/tmp/vstage-{bundle.name}", ignore_errors=True)


@pytest.mark.skipif(Path("/tmp/vsite").exists(), reason="a GPU machine's /tmp/vsite is not touched")
def test_release_bench_never_switches_releases_under_a_multimodal_run(tmp_path):
    """vlm_bench.sh's run loads vLLM from /tmp/vsite: while it goes on (its job.pid names a live
    process, here this test's own), the switch to another bundle stops in one line."""
    bundle = tmp_path / f"vllm-made-up-{os.getpid()}-switch"
    _part(bundle, "part1a", {"vllm_C.tar.xz.00": b"a"})
    _part(bundle, "part1b", {"vllm_C.tar.xz.01": b"b"})
    run = Path(f"/tmp/vlm-made-up-{os.getpid()}")
    run.mkdir()
    (run / "job.pid").write_text(f"{os.getpid()}\n")
    try:
        proc = _release_bench(tmp_path, str(bundle), "5")
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"a multimodal run is going on ({run}): wait for it first"
        assert not Path("/tmp/vsite").exists()
    finally:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(f"/tmp/vstage-{bundle.name}", ignore_errors=True)
