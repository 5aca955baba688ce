"""The watched directory gives writers time to finish and follows its root when it is replaced.

Real files and a real watchfiles watcher (inotify); every wait is bounded.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from reconciler.sources.watch import DirectorySource

SVC = """apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  clusterIP: {ip}
  ports: [{{name: http, port: 80, protocol: TCP}}]
"""


def svc(path: Path, name: str, ip: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SVC.format(name=name, ip=ip))


def names(src: DirectorySource) -> list[str]:
    return sorted(o.name for o in src.snapshot().objects)


def started(src: DirectorySource) -> DirectorySource:
    src.snapshot()
    src.start()
    time.sleep(0.2)  # let the watcher settle
    return src


def test_snapshot_waits_while_git_holds_the_index_lock(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    src = DirectorySource(str(tmp_path), lock_wait=10.0)
    assert names(src) == ["a"]
    lock = tmp_path / ".git" / "index.lock"
    lock.write_text("")  # a checkout begins: one file written, the next not yet
    svc(tmp_path / "b.yaml", "b", "10.96.0.11")
    result: list[list[str]] = []
    reader = threading.Thread(target=lambda: result.append(names(src)))
    reader.start()
    try:
        reader.join(0.5)
        assert reader.is_alive(), "read the work tree while git was writing it"
        svc(tmp_path / "c.yaml", "c", "10.96.0.12")
    finally:
        lock.unlink()  # the checkout ends
        reader.join(5)
    assert result == [["a", "b", "c"]]


def test_a_stop_while_git_holds_the_lock_reads_nothing_of_the_tree(tmp_path: Path) -> None:
    """SIGTERM during a checkout ends the wait, but the half-written tree is not read (the
    daemon's last sync must not program it)."""
    (tmp_path / ".git").mkdir()
    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    stop = threading.Event()
    src = DirectorySource(str(tmp_path), lock_wait=10.0, stop_event=stop)
    assert names(src) == ["a"]
    (tmp_path / ".git" / "index.lock").write_text("")
    (tmp_path / "a.yaml").unlink()  # git half-way: a.yaml gone, its new place not written yet
    result = []
    reader = threading.Thread(target=lambda: result.append(src.snapshot(objects=False)))
    reader.start()
    reader.join(0.3)
    stop.set()
    reader.join(5)
    assert not reader.is_alive()
    snap = result[0]
    assert not snap.changed and snap.removed_objects == [] and snap.added_objects == [] and snap.stopped


def test_the_lock_of_the_work_tree_above_the_root_counts_too(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index.lock").write_text("")
    svc(tmp_path / "services" / "a.yaml", "a", "10.96.0.10")
    src = DirectorySource(str(tmp_path / "services"), lock_wait=0.3)
    t0 = time.monotonic()
    assert names(src) == ["a"]
    assert time.monotonic() - t0 >= 0.3


def test_a_stale_lock_is_warned_about_once_and_then_not_waited_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index.lock").write_text("")
    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    src = DirectorySource(str(tmp_path), lock_wait=1.0)
    with caplog.at_level(logging.WARNING, logger="reconciler.sources.watch"):
        t0 = time.monotonic()
        assert names(src) == ["a"]
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert names(src) == ["a"]
        second = time.monotonic() - t0
    assert first >= 1.0 and second < 0.5
    warned = [r.getMessage() for r in caplog.records if "index.lock" in r.getMessage()]
    assert len(warned) == 1 and "not waiting for this lock again" in warned[0]


def test_after_waiting_for_git_the_whole_tree_is_compared(tmp_path: Path) -> None:
    """The watcher may still hold back the events of git's last writes when the lock goes: the
    files it did not name yet are found all the same."""
    (tmp_path / ".git").mkdir()
    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    svc(tmp_path / "b.yaml", "b", "10.96.0.11")
    src = DirectorySource(str(tmp_path))
    src.snapshot()
    lock = tmp_path / ".git" / "index.lock"
    lock.write_text("")
    svc(tmp_path / "a.yaml", "a", "10.96.0.20")
    svc(tmp_path / "b.yaml", "b", "10.96.0.210")  # (its event not handed on yet)
    src._dirty = {str(tmp_path / "a.yaml")}
    threading.Timer(0.2, lock.unlink).start()
    ips = {o.name: o.body["spec"]["clusterIP"] for o in src.snapshot().objects}
    assert ips == {"a": "10.96.0.20", "b": "10.96.0.210"}


def test_a_stop_ends_the_wait_for_git(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index.lock").write_text("")
    stop = threading.Event()
    src = DirectorySource(str(tmp_path), lock_wait=30.0, stop_event=stop)
    reader = threading.Thread(target=src.snapshot)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()
    stop.set()  # SIGTERM, or the --config file changed
    reader.join(5)
    assert not reader.is_alive()


def test_git_s_own_files_and_editor_swap_files_wake_no_one(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    svc(tmp_path / "a" / "b" / "web.yaml", "web", "10.96.0.10")
    events = threading.Event()
    src = started(DirectorySource(str(tmp_path), events.set))
    try:
        svc(tmp_path / "a" / "b" / "web.yaml", "web", "10.96.0.11")
        assert events.wait(5), "the watch is not set up"
        time.sleep(0.1)
        events.clear()
        (tmp_path / ".git" / "FETCH_HEAD").write_text("0" * 40 + "\n")
        (tmp_path / ".git" / "objects").mkdir()
        (tmp_path / "a" / ".web.yaml.swp").write_bytes(b"\0" * 64)
        assert not events.wait(0.6), "a hidden path woke the reconciler"
        svc(tmp_path / "a" / "b" / "web.yaml", "web", "10.96.0.20")
        assert events.wait(5), "a manifest change did not"
    finally:
        src.stop()


def test_a_burst_of_changes_is_logged_by_a_few_names_and_a_count(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pull of thousands of files made one debug line naming each; ten are named, the rest counted."""
    events = threading.Event()
    src = started(DirectorySource(str(tmp_path), events.set))
    try:
        with caplog.at_level(logging.DEBUG, logger="reconciler.sources.watch"):
            for i in range(25):
                svc(tmp_path / f"s{i:02}.yaml", f"s{i}", f"10.96.0.{10 + i}")
            assert events.wait(5), "the watch is not set up"
            deadline = time.monotonic() + 5
            while sum(map(_changes_in, _change_lines(caplog))) < 25 and time.monotonic() < deadline:
                time.sleep(0.05)
        lines = _change_lines(caplog)
        assert sum(map(_changes_in, lines)) >= 25
        assert all(line.count(", ") <= 9 for line in lines), lines
    finally:
        src.stop()


def _change_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("manifest changes: ")]


def _changes_in(line: str) -> int:
    """How many changes a "manifest changes: a, b and N more" line reports."""
    named, _, more = line.partition(" and ")
    return named.count(", ") + 1 + (int(more.split()[0]) if more else 0)


@pytest.mark.parametrize("folder", ["", "edge"], ids=["at-the-root", "in-a-subfolder"])
def test_a_config_map_volume_s_data_swap_wakes_it_and_is_read(tmp_path: Path, folder: str) -> None:
    """kubelet's atomic writer: ..<timestamp>/ holds the files, ..data links to it, the visible
    names link into ..data; an update makes a new ..<timestamp> and renames a new ..data link
    over the old one. Only `..`-prefixed paths change."""
    cm = tmp_path / folder
    svc(cm / "..2026_12_03_01" / "web.yaml", "web", "10.96.0.10")
    os.symlink("..2026_12_03_01", cm / "..data")
    os.symlink("..data/web.yaml", cm / "web.yaml")
    events = threading.Event()
    src = started(DirectorySource(str(tmp_path), events.set))
    try:
        assert src.snapshot().objects[0].body["spec"]["clusterIP"] == "10.96.0.10"
        events.clear()
        svc(cm / "..2026_12_03_02" / "web.yaml", "web", "10.96.0.20")
        os.symlink("..2026_12_03_02", cm / "..data_tmp")
        os.rename(cm / "..data_tmp", cm / "..data")
        shutil.rmtree(cm / "..2026_12_03_01")
        assert events.wait(5), "the ..data swap woke no one"
        assert src.snapshot().objects[0].body["spec"]["clusterIP"] == "10.96.0.20"
    finally:
        src.stop()


def wait_for(src: DirectorySource, events: threading.Event, want: list[str]) -> list[str]:
    """Snapshots after each wake-up until the objects are `want` (bounded: 5 s). Only after a
    wake-up: an idle snapshot walks the whole tree, which would hide a watch that went deaf."""
    deadline = time.monotonic() + 5
    got: list[str] = []
    while time.monotonic() < deadline:
        if not events.wait(max(0.0, deadline - time.monotonic())):
            break
        events.clear()
        got = names(src)
        if got == want:
            break
    return got


def test_a_symlinked_root_is_followed_when_the_link_is_swapped(tmp_path: Path) -> None:
    """git-sync --link: the root is a symlink to a worktree, swapped to a new one on every sync,
    and the old worktree removed."""
    svc(tmp_path / "rev1" / "a.yaml", "a", "10.96.0.10")
    os.symlink("rev1", tmp_path / "current")
    events = threading.Event()
    src = started(DirectorySource(str(tmp_path / "current"), events.set, root_check_ms=200))
    try:
        svc(tmp_path / "rev2" / "b.yaml", "b", "10.96.0.11")
        os.symlink("rev2", tmp_path / "tmp-link")
        os.rename(tmp_path / "tmp-link", tmp_path / "current")
        assert wait_for(src, events, ["b"]) == ["b"]
        shutil.rmtree(tmp_path / "rev1")
        svc(tmp_path / "rev2" / "c.yaml", "c", "10.96.0.12")  # seen: the new target is watched
        assert wait_for(src, events, ["b", "c"]) == ["b", "c"]
        assert src.failures == 0
    finally:
        src.stop()


@contextmanager
def watched_state(tmp_path: Path) -> Iterator[tuple[Path, DirectorySource, threading.Event]]:
    """<tmp>/state with one Service, watched (the root's identity checked every 200 ms)."""
    root = tmp_path / "state"
    svc(root / "a.yaml", "a", "10.96.0.10")
    events = threading.Event()
    src = started(DirectorySource(str(root), events.set, root_check_ms=200))
    try:
        yield root, src, events
    finally:
        src.stop()


def test_a_root_removed_and_made_again_is_followed(tmp_path: Path) -> None:
    with watched_state(tmp_path) as (root, src, events):
        shutil.rmtree(root)
        assert events.wait(5), "the root's removal woke no one"
        events.clear()
        errors = src.snapshot().errors
        assert errors and "no such directory" in str(errors[0])
        svc(root / "b.yaml", "b", "10.96.0.11")  # a fresh clone (often with the old inode)
        assert wait_for(src, events, ["b"]) == ["b"]
        svc(root / "c.yaml", "c", "10.96.0.12")  # seen: the new directory is watched
        assert wait_for(src, events, ["b", "c"]) == ["b", "c"]
        assert src.failures == 0


def test_a_change_made_while_the_new_root_s_watch_is_set_up_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import watchfiles

    real = watchfiles.watch
    starts: list[float] = []

    def slow_to_start(*paths, **kwargs):  # type: ignore[no-untyped-def]
        starts.append(time.monotonic())
        if len(starts) > 1:
            time.sleep(0.5)  # (a loaded machine; a big tree to add watches to)
        return real(*paths, **kwargs)

    monkeypatch.setattr(watchfiles, "watch", slow_to_start)
    with watched_state(tmp_path) as (root, src, events):
        shutil.rmtree(root)
        svc(root / "b.yaml", "b", "10.96.0.11")
        deadline = time.monotonic() + 5
        while len(starts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert names(src) == ["b"]  # (what the wake-ups so far asked for)
        events.clear()
        svc(root / "c.yaml", "c", "10.96.0.12")  # before the new watch is there
        assert wait_for(src, events, ["b", "c"]) == ["b", "c"]


def test_when_inotify_s_limits_are_reached_the_directory_is_polled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """inotify's limits (max_user_watches, max_user_instances) reached: watchfiles raises; the
    watcher goes on by polling rather than retrying inotify for ever. Another error is retried."""
    import watchfiles

    real = watchfiles.watch
    calls: list[bool] = []

    def limited(*paths, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(bool(kwargs.get("force_polling")))
        if len(calls) == 1:
            raise RuntimeError("something else")  # retried with inotify
        if not kwargs.get("force_polling"):
            raise OSError("OS file watch limit reached.")
        return real(*paths, **kwargs)

    monkeypatch.setattr(watchfiles, "watch", limited)
    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    events = threading.Event()
    src = DirectorySource(str(tmp_path), events.set)
    src.snapshot()
    src.start()
    try:
        deadline, written = time.monotonic() + 10, []
        while time.monotonic() < deadline:  # (a file written before the poller's first scan is no change)
            events.clear()
            written.append(f"b{len(written)}")
            svc(tmp_path / f"{written[-1]}.yaml", written[-1], f"10.96.1.{len(written)}")
            if events.wait(1.0) and calls[-1:] == [True]:
                break
        assert calls[:3] == [False, False, True], calls
        assert events.is_set(), "the polling watch saw nothing"
        assert names(src) == sorted(["a", *written]) and src.failures == 2
    finally:
        src.stop()


def git(cwd: Path, *args: str) -> None:
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main",
                    *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_a_git_pull_is_read_whole(tmp_path: Path) -> None:
    """The edge flow: a clone that `git pull --ff-only` brings forward, watched while a reader
    snapshots on every wake-up, as the run loop does. No snapshot mixes the two commits."""
    upstream, clone = tmp_path / "upstream", tmp_path / "clone"
    upstream.mkdir()
    git(upstream, "init", "-q")
    files = 2000

    def commit(version: int) -> None:
        for i in range(files):
            svc(upstream / "svcs" / f"s{i:03}.yaml", f"s{i}", f"10.96.{version}.{i % 250}")
        git(upstream, "add", "-A")
        git(upstream, "commit", "-qm", f"v{version}")

    commit(1)
    git(tmp_path, "clone", "-q", str(upstream), str(clone))
    commit(2)
    events = threading.Event()
    src = started(DirectorySource(str(clone), events.set))
    seen: list[set[str]] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            if events.wait(0.05):
                events.clear()
                seen.append({o.body["spec"]["clusterIP"].split(".")[2] for o in src.snapshot().objects})

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        git(clone, "pull", "-q", "--ff-only")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not seen or seen[-1] != {"2"}):
            time.sleep(0.05)
    finally:
        done.set()
        thread.join(5)
        src.stop()
    assert seen and seen[-1] == {"2"}
    assert all(len(versions) == 1 for versions in seen), [sorted(v) for v in seen]


def test_a_symlinked_directory_is_warned_about_not_silently_skipped(tmp_path: Path) -> None:
    """A link to a directory is not followed (nor could it be watched): its manifests would be
    missing without a word; both the one-shot read and the watched directory say so."""
    from reconciler.sources.manifests import load_directory

    svc(tmp_path / "shared" / "apps" / "b.yaml", "b", "10.96.0.11")
    svc(tmp_path / "root" / "a.yaml", "a", "10.96.0.10")
    (tmp_path / "root" / "apps").symlink_to(tmp_path / "shared" / "apps")
    want = f"{tmp_path}/root/apps: a symbolic link to a directory: not followed"
    loaded = load_directory(str(tmp_path / "root"))
    assert [o.name for o in loaded.objects] == ["a"] and any(w.startswith(want) for w in loaded.warnings)
    snap = DirectorySource(str(tmp_path / "root")).snapshot()
    assert [o.name for o in snap.objects] == ["a"] and any(w.startswith(want) for w in snap.warnings)


def snapshot_within(src: DirectorySource, seconds: float = 10.0):  # type: ignore[no-untyped-def]
    """src.snapshot(), which must return in time (a FIFO once blocked it for good: the thread
    is left behind then, and the test fails)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(src.snapshot()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, "snapshot() blocked"
    return out[0]


def release_fifo(path: Path) -> None:
    """Let go of a reader blocked on the FIFO (a failed test's thread), if any."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_named_like_a_manifest_is_an_error_and_never_waited_on(tmp_path: Path) -> None:
    """mkfifo x.yaml under the root: the periodic full walk used to open it and wait for a writer
    for good (no sync, no log line, SIGTERM not acted on)."""
    with watched_state(tmp_path) as (root, src, events):
        fifo = root / "x.yaml"
        os.mkfifo(fifo)
        try:
            assert events.wait(5)
            for full in (False, True):  # the watcher's path, then the periodic resync's walk
                if full:
                    src.rescan()
                snap = snapshot_within(src)
                assert [str(e) for e in snap.errors] == [f"{fifo}: not a regular file (a FIFO): manifests are read "
                                                         "from files only"], full
                assert sorted(o.name for o in src.snapshot().objects) == ["a"]
        finally:
            release_fifo(fifo)


def test_a_manifest_turned_into_a_link_to_nothing_is_an_error_not_a_removal(tmp_path: Path) -> None:
    """A git commit that points b.yaml at a missing file: the watcher's path used to drop b's
    objects as if the file were deleted (applied), the next full walk then call it an error."""
    with watched_state(tmp_path) as (root, src, events):
        svc(root / "b.yaml", "b", "10.96.0.11")
        assert wait_for(src, events, ["a", "b"]) == ["a", "b"]
        os.symlink("../missing.yaml", root / "b.tmp")
        os.rename(root / "b.tmp", root / "b.yaml")
        assert events.wait(5)
        for full in (False, True):
            if full:
                src.rescan()
            snap = src.snapshot()
            assert [str(e) for e in snap.errors] == [f"{root / 'b.yaml'}: a symbolic link to nothing "
                                                     "(../missing.yaml)"], full


@pytest.mark.parametrize("content, via_error", [("", False), ("# nothing yet\n---\n", False), ("", True)])
def test_a_manifest_emptied_is_a_removal_said_in_the_log(
        tmp_path: Path, content: str, via_error: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A file that held objects and now holds none (a template that rendered nothing, a write cut
    short) removes them, as git would have it, but not silently; also when a read with an error
    (which kept them) came between."""
    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    svc(tmp_path / "b.yaml", "b", "10.96.0.11")
    src = DirectorySource(str(tmp_path))
    assert names(src) == ["a", "b"]
    if via_error:
        (tmp_path / "b.yaml").write_text("spec: [\n")
        src.rescan()
        assert src.snapshot().errors
    (tmp_path / "b.yaml").write_text(content)
    src.rescan()
    with caplog.at_level(logging.WARNING, logger="reconciler.sources.watch"):
        assert names(src) == ["a"]
        src.rescan()
        assert names(src) == ["a"]  # (said once: when it happens)
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'b.yaml'} holds no object any more (it held 1): removing them"]


def test_files_under_a_linked_folder_are_not_read_as_they_change(tmp_path: Path) -> None:
    """A symbolic link to a folder is not followed (warned about); the watcher may follow it all
    the same, and a file changed there used to be read (programmed), then dropped by the next walk."""
    svc(tmp_path / "elsewhere" / "x.yaml", "x", "10.96.0.20")
    root = tmp_path / "state"
    svc(root / "a.yaml", "a", "10.96.0.10")
    os.symlink(tmp_path / "elsewhere", root / "linked")
    events = threading.Event()
    src = started(DirectorySource(str(root), events.set, root_check_ms=200))
    try:
        snap = src.snapshot()
        assert any("a symbolic link to a directory: not followed" in str(w) for w in snap.warnings)
        svc(tmp_path / "elsewhere" / "y.yaml", "y", "10.96.0.21")
        svc(root / "b.yaml", "b", "10.96.0.11")  # (a change the watcher does report)
        assert wait_for(src, events, ["a", "b"]) == ["a", "b"]
        time.sleep(0.3)
        assert names(src) == ["a", "b"]
    finally:
        src.stop()


def test_a_folder_that_cannot_be_listed_is_an_error_not_its_manifests_gone(tmp_path: Path) -> None:
    """A folder the process may not read (chmod 000, without CAP_DAC_*): the walk skipped it
    silently, and its services were removed. Its manifests are unknown: an error, which holds."""
    from reconciler.sources.manifests import load_directory
    from reconciler.sources.objects import InputErrors

    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    svc(tmp_path / "team" / "b.yaml", "b", "10.96.0.11")
    real_scandir = os.scandir

    def denied(path):  # type: ignore[no-untyped-def]  # (the tests run as root, which reads anything)
        if str(path).endswith("team"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", denied)
        with pytest.raises(InputErrors) as exc:
            load_directory(tmp_path)
        assert str(exc.value.errors[0]) == f"{tmp_path / 'team'}: cannot read this directory: Permission denied"
        snap = DirectorySource(str(tmp_path)).snapshot()
        assert [str(e) for e in snap.errors] == [str(exc.value.errors[0])] and not snap.objects


def test_a_folder_gone_while_the_tree_is_walked_is_no_error(tmp_path: Path) -> None:
    """A folder removed between its parent's listing and its own (rsync --delete, rm -r during a
    walk) is as if listed a moment later: gone, not unreadable."""
    from reconciler.sources.manifests import manifest_files

    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    svc(tmp_path / "team" / "b.yaml", "b", "10.96.0.11")
    real_scandir = os.scandir

    def gone(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("team"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", gone)
        assert manifest_files(tmp_path) == [str(tmp_path / "a.yaml")]


def test_a_read_that_fails_midway_is_an_input_error(tmp_path: Path) -> None:
    """EIO (or EAGAIN on a FUSE mount) while a file is read: its error, not an OSError that
    escapes (one stopped the daemon's loop on a first start)."""
    from reconciler.sources.manifests import may_hold_a_node, read_bytes
    from reconciler.sources.objects import InputError

    svc(tmp_path / "a.yaml", "a", "10.96.0.10")
    real_fstat = os.fstat

    def failing(fd):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fstat", failing)
        with pytest.raises(InputError, match="cannot read: .*Input/output error"):
            read_bytes(str(tmp_path / "a.yaml"))
        assert may_hold_a_node(str(tmp_path / "a.yaml"))  # (cannot be read: it may)
    assert os.fstat is real_fstat


def test_a_manifest_linked_through_a_linked_folder_is_read_again_when_its_target_changes(tmp_path: Path) -> None:
    """root/svc.yaml -> current/svc.yaml, root/current -> a folder elsewhere: an edit of the target
    is seen through the linked folder, which is not read itself; the walk then compares every file
    and reads svc.yaml again (its signature follows the link)."""
    svc(tmp_path / "release1" / "svc.yaml", "one", "10.96.0.20")
    root = tmp_path / "state"
    svc(root / "a.yaml", "a", "10.96.0.10")
    os.symlink(tmp_path / "release1", root / "current")
    os.symlink("current/svc.yaml", root / "svc.yaml")
    events = threading.Event()
    src = started(DirectorySource(str(root), events.set, root_check_ms=200))
    try:
        assert names(src) == ["a", "one"]
        svc(tmp_path / "release1" / "svc.yaml", "two", "10.96.0.20")
        assert wait_for(src, events, ["a", "two"]) == ["a", "two"]
    finally:
        src.stop()


def test_a_link_to_a_folder_made_while_watched_is_news_at_once(tmp_path: Path) -> None:
    """Its warning (not followed) comes with the change that made it, not with some later one: the
    walk changed no file, and a snapshot that changed nothing is not looked at."""
    svc(tmp_path / "elsewhere" / "x.yaml", "x", "10.96.0.20")
    with watched_state(tmp_path) as (root, src, events):
        os.symlink(tmp_path / "elsewhere", root / "linked")
        assert events.wait(5)
        deadline = time.monotonic() + 5
        snap = src.snapshot()
        while not snap.changed and time.monotonic() < deadline:  # (until the watcher reported it)
            events.wait(0.5)
            snap = src.snapshot()
        assert snap.changed and any("a symbolic link to a directory: not followed" in str(w) for w in snap.warnings)
        assert not src.snapshot().changed  # said once


def test_a_watch_that_keeps_failing_is_retried_ever_more_slowly_and_said_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A folder the process may not read (an edge unit without CAP_DAC_*): not two log lines a
    second for as long as it lasts; tried again after 1 s, 2 s, ... up to 30 s."""
    import logging

    import watchfiles

    from reconciler.sources.watch import DirectorySource

    def failing(*_a: object, **_k: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(watchfiles, "watch", failing)
    src = DirectorySource(str(tmp_path), lambda: None)
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        if len(waits) >= 1100:  # (days of it: the delay's exponent does not overflow)
            src._stop.set()
        return src._stop.is_set()

    monkeypatch.setattr(src._stop, "wait", wait)
    with caplog.at_level(logging.DEBUG, logger="reconciler.sources.watch"):
        src._watch()
    assert waits[:7] == [1, 2, 4, 8, 16, 30, 30] and set(waits[5:]) == {30}
    said = [r for r in caplog.records if "failed: " in r.getMessage()]
    assert [r.levelno for r in said[:7]] == [logging.WARNING] + [logging.DEBUG] * 6
    assert sum(r.levelno == logging.WARNING for r in said) == 1
    assert src.failures == 1100
