"""The interpreter startup hook (core/_startup.py + unickpt-startup.pth): cheap, inert unless asked."""
import subprocess
import sys
import textwrap

import pytest

from unickpt import _startup


def _run(code: str, **env_updates: str) -> str:
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICKPT_")}
    env.update(env_updates)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_pth_installs_hook_without_importing_torch():
    # the .pth shipped by setup.py runs in every interpreter: it must not import torch or any framework
    out = _run("import sys; print('unickpt._startup' in sys.modules, 'torch' in sys.modules)")
    assert out == "True False"


def test_accelerate_untouched_without_env_var():
    # the hook runs the plugin's startup(), which patches nothing unless UNICKPT_ACCELERATE is set
    out = _run("import accelerate, sys; print('unickpt.accelerate._patch' in sys.modules, "
               "'unickpt.accelerate._activate' in sys.modules)")
    assert out == "False True"
    out = _run("import accelerate, sys; print('unickpt.accelerate._patch' in sys.modules)", UNICKPT_ACCELERATE="1")
    assert out == "True"


def test_hooks_come_from_the_entry_points_of_unickpt_distributions(tmp_path):
    # the installed package declares its hooks as entry points (pyproject.toml), read without importlib.metadata
    assert _startup.read_hooks() == {"accelerate": "unickpt.accelerate._activate:startup",
                                     "deepspeed": "unickpt.deepspeed._activate:startup",
                                     "transformers.trainer": "unickpt.transformers._activate:startup"}
    for dist, text in {"unickpt_myfw-1.0.dist-info": "[unickpt.startup]\nmyfw = unickpt_myfw.hook:startup\n"
                                                     "[other.group]\nx = y:z\n",
                       "other_pkg-2.0.dist-info": "[unickpt.startup]\nevil = other_pkg:run\n"}.items():
        (tmp_path / dist).mkdir()
        (tmp_path / dist / "entry_points.txt").write_text(text)
    # only distributions named unickpt* are read (the hook runs in every interpreter: it stays cheap)
    assert _startup.read_hooks([str(tmp_path)]) == {"myfw": "unickpt_myfw.hook:startup"}


def test_hook_disabled_globally():
    out = _run("import sys; print(any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))",
               UNICKPT_STARTUP_HOOK="0")
    assert out == "False"


@pytest.fixture
def fake_framework(tmp_path, monkeypatch):
    (tmp_path / "fake_fw_for_hook.py").write_text("VALUE = 41\n")
    (tmp_path / "fake_fw_plugin.py").write_text(textwrap.dedent("""
        import sys
        calls = []
        def install():
            fw = sys.modules["fake_fw_for_hook"]
            calls.append(fw.VALUE)   # runs after the framework module finished executing
            fw.VALUE += 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fake_fw_for_hook", "fake_fw_plugin"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(_startup.HOOKS, "fake_fw_for_hook", "fake_fw_plugin:install")
    _startup.install()


def test_post_import_hook_runs_after_module_body(fake_framework):
    import fake_fw_for_hook
    import fake_fw_plugin
    assert fake_fw_plugin.calls == [41]
    assert fake_fw_for_hook.VALUE == 42
    # the real loader is restored on the module, so introspection and reload see the usual loader
    assert type(fake_fw_for_hook.__loader__).__name__ == "SourceFileLoader"
    assert type(fake_fw_for_hook.__spec__.loader).__name__ == "SourceFileLoader"


def test_failing_hook_warns_and_keeps_import(fake_framework, monkeypatch):
    monkeypatch.setitem(_startup.HOOKS, "fake_fw_for_hook", "fake_fw_plugin:missing_function")
    with pytest.warns(RuntimeWarning, match=r"activating the fake_fw_for_hook plugin \(fake_fw_plugin:missing_function\) failed"):
        import fake_fw_for_hook
    assert fake_fw_for_hook.VALUE == 41
