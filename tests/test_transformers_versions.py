"""Only verified transformers versions run state mixers: a model with them is refused from its
config, naming the installed version, on any other (unless the environment says to try it);
other models run with one warning; pyproject.toml's bound and the pinned test set agree with
the verified range."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from batchgen import LLM
from batchgen.model import loader, versions
from tests.families import save_family_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def configs(tmp_path):
    return {f: AutoConfig.from_pretrained(save_family_config(f, tmp_path / f))
            for f in ("mamba2", "jamba", "llama")}


@pytest.mark.parametrize("version", ["5.17.0", "5.26.0", "5.25.1.dev0"])
def test_state_mixers_are_refused_on_an_unverified_transformers(configs, monkeypatch, version):
    monkeypatch.setattr(versions, "installed", lambda: version)
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    for family in ("mamba2", "jamba"):
        with pytest.raises(ValueError, match=rf"{family}.*transformers {re.escape(version)} is "
                                             r"installed.*BATCHGEN_UNVERIFIED_TRANSFORMERS"):
            loader.check_supported(configs[family])


def test_the_environment_lifts_the_refusal_and_attention_models_only_warn(configs, monkeypatch,
                                                                          caplog):
    monkeypatch.setattr(versions, "installed", lambda: "5.99.0")
    monkeypatch.setattr(versions, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        loader.check_supported(configs["llama"])
        loader.check_supported(configs["llama"])
        monkeypatch.setenv(versions.ALLOW_ENV, "1")
        loader.check_supported(configs["mamba2"])
    warned = [r for r in caplog.records if "transformers 5.99.0 is installed" in r.message]
    assert len(warned) == 1  # once per version


def test_verified_versions_pass_without_a_word(configs, caplog):
    for version in versions.VERIFIED:
        assert versions.is_verified(version)
    assert versions.is_verified(versions.installed()), "the suite runs on an unverified version"
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        loader.check_supported(configs["mamba2"])
    assert not caplog.records


def test_the_refusal_comes_before_any_weight_is_read(tmp_path, monkeypatch):
    path = save_family_config("mamba2", tmp_path / "m")
    monkeypatch.setattr(versions, "installed", lambda: "5.26.0")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    (path / "model.safetensors").write_bytes(b"")  # a folder that looks complete
    with pytest.raises(ValueError, match="transformers 5.26.0"):
        LLM(str(path))


def test_pyproject_and_the_pins_agree_with_the_verified_range():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"transformers>={versions.VERIFIED[0]},<={versions.VERIFIED[1]}"' in text
    pins = (ROOT / "scripts" / "constraints.txt").read_text()
    pinned = re.search(r"^transformers==(\S+)$", pins, re.M)
    assert pinned and versions.is_verified(pinned.group(1))


def test_check_latest_reports_new_families_and_failures(tmp_path):
    """scripts/check_latest_report.py turns the JUnit XML into the block docs/families.md
    records: families new in that transformers or to the matrix, and each failure."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_latest_report", ROOT / "scripts" / "check_latest_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = mod.MATRIX_TEST
    (tmp_path / "j.xml").write_text(f"""<testsuites><testsuite>
      <testcase classname="tests.test_families" name="{t}[llama]"/>
      <testcase classname="tests.test_families" name="{t}[ergo]"/>
      <testcase classname="tests.test_families" name="{t}[brand_new]"><properties>
        <property name="new_family" value="judged: parity"/></properties></testcase>
      <testcase classname="tests.test_families" name="{t}[mamba2]">
        <failure message="mamba2: tokens differ&#10;more"/></testcase>
      <testcase classname="tests.test_hybrid_models" name="test_x[jamba]">
        <failure message="wrong tokens"/></testcase>
      <testcase classname="tests.test_hybrid_models" name="test_y"/>
    </testsuite></testsuites>""")
    block = mod.report(mod.outcomes(tmp_path / "j.xml"), "5.25.0")
    assert "4 families; 1 failed, 3 passed" in block
    assert "new: `ergo`: passed (expected: parity)" in block
    assert "new: `brand_new`: passed (expected: no expectation yet); judged: parity" in block
    assert "FAILED: `mamba2`: mamba2: tokens differ" in block and "more" not in block
    assert "`test_hybrid_models`: 1 passed, 1 failed" in block
    assert "FAILED: `test_hybrid_models::test_x[jamba]`: wrong tokens" in block
    doc = tmp_path / "families.md"
    doc.write_text("# families\n")
    mod.record(block, doc)
    mod.record(block, doc)  # replaced, not appended twice
    assert doc.read_text().count(mod.START) == 1 and "brand_new" in doc.read_text()
