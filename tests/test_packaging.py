"""A non-editable install: the wheel carries the shipped profiles (found through importlib.resources) and the
version; `casspec --version` prints it."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_profiles_and_an_installed_casspec_finds_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("casspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "profiles").glob("*.json"))
    assert shipped and all(f"dytc/profiles/{n}" in names for n in shipped)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, cwd=tmp_path)
    probe = ("import json, casspec, dytc.latency as L; d = L.default_profiles(); "
             "p = json.loads(sorted(d.glob('*.json'))[0].read_text()); "
             "print(d); print(casspec.__version__); "
             "print(L.select_profile(p['machine'], p['model'], p['dtype'], p['kernels']))")
    # -I: isolated (no cwd, no user site, no PYTHONPATH), so only the installed copy can answer
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                         check=True, capture_output=True, text=True, cwd=tmp_path).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1] == "0.1.0"
    assert out[2].startswith(str(site)) and out[2].endswith(".json")


def test_version_flag(capsys):
    import pytest

    from casspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("casspec ")
