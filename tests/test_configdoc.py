"""docs/configuration.md is what `python -m tools.configdoc` makes of the config classes now: a
field added, renamed or redocumented without regenerating it fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

from tools import configdoc

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_md_is_generated_from_the_current_source() -> None:
    committed = (ROOT / configdoc.TARGET).read_text()
    assert committed == configdoc.render(ROOT), \
        "docs/configuration.md is stale: run `python -m tools.configdoc` (or `make docs`)"


def test_a_new_field_shows_with_its_flag_variable_default_and_docstring(tmp_path: Path) -> None:
    for package in configdoc.PRODUCT:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*_pb2*"))
    config = tmp_path / "conductor" / "config.py"
    anchor = "    hide_kv_transfer: bool = False\n"
    assert anchor in config.read_text()
    config.write_text(config.read_text().replace(
        anchor, '    probe_knob_s: float = 1.5\n    """A knob the test adds."""\n' + anchor))
    text = configdoc.render(tmp_path)
    assert text != configdoc.render(ROOT)
    assert ("- **`probe_knob_s`** (`--probe-knob-s`, `KVCLUSTER_CONDUCTOR_PROBE_KNOB_S`): "
            "float, default `1.5`. A knob the test adds.") in text


def test_every_config_class_and_the_launcher_are_covered() -> None:
    text = (ROOT / configdoc.TARGET).read_text()
    for name in ("ConductorConfig", "WorkerConfig", "PoolConfig", "ConnectorSettings",
                 "`--worker-tls`", "`KVCLUSTER_POOL_MASTER_ADDR`", "`KVCLUSTER_STEP_LOG`"):
        assert name in text, name
