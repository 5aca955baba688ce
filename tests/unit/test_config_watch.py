"""`run` exits when its --config file's content changes, as kube-proxy does."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from reconciler.config_watch import ConfigFileWatch

CONFIG = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n"


def put(path: Path, text: str) -> None:
    """Written whole and renamed into place (write_text empties the file first: a watch that
    looks in between sees a change, rightly)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _watch(path: Path) -> tuple[ConfigFileWatch, threading.Event]:
    changed = threading.Event()
    watch = ConfigFileWatch(str(path), changed.set, period=0.02)
    watch.start()
    return watch, changed


def test_a_new_content_is_a_change_the_same_content_or_a_missing_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "config.conf"
    put(path, CONFIG)
    watch, changed = _watch(path)
    try:
        put(path, CONFIG)  # rewritten as it was (a re-apply of the same ConfigMap)
        path.unlink()  # gone for a while (kube-proxy ignores a removal too)
        assert not changed.wait(0.3)
        put(path, CONFIG)
        assert not changed.wait(0.2)
        put(path, CONFIG.replace("nftables", "iptables"))
        assert changed.wait(2)
    finally:
        watch.stop()


def test_a_config_map_style_symlink_swap_is_a_change(tmp_path: Path) -> None:
    """A ConfigMap volume: config.conf -> ..data/config.conf, ..data -> a timestamped folder,
    swapped by a rename."""
    old, new = tmp_path / "..2026_01", tmp_path / "..2026_02"
    for folder, mode in ((old, "nftables"), (new, "iptables")):
        folder.mkdir()
        (folder / "config.conf").write_text(CONFIG.replace("nftables", mode))
    os.symlink(old.name, tmp_path / "..data")
    os.symlink("..data/config.conf", tmp_path / "config.conf")
    watch, changed = _watch(tmp_path / "config.conf")
    try:
        assert not changed.wait(0.2)
        os.symlink(new.name, tmp_path / "..data_tmp")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        assert changed.wait(2)
    finally:
        watch.stop()


def test_stop_ends_the_thread_without_a_call(tmp_path: Path) -> None:
    path = tmp_path / "config.conf"
    path.write_text(CONFIG)
    watch, changed = _watch(path)
    watch.stop()
    path.write_text("changed")
    assert not changed.wait(0.2)
