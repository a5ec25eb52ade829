"""The container test's own helpers, without an engine: apt's mirror, the image's USER, mount
targets inside an image tree, and the run dir in the image's command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from container_base import FALLBACK_MIRROR, apt_mirror, base_image_tag
from container_image import run_dir_argument
from container_launch import image_user, inside


def test_apt_mirror_reads_deb822_and_one_line_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb-src deb\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm\n bookworm-updates\nComponents: main\n"
    )
    assert apt_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    assert apt_mirror("bookworm-updates", tmp_path) == "http://mirror.example/debian"
    assert apt_mirror("trixie", tmp_path) == FALLBACK_MIRROR
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.example/debian trixie main\n"
        "deb-src http://src.example/debian trixie main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://list.example/debian trixie main\n"
    )
    assert apt_mirror("trixie", tmp_path) == "http://list.example/debian"


def test_base_image_tag_is_keyed_by_the_mirror():
    a, b = base_image_tag("http://a.example/debian"), base_image_tag("http://b.example/debian")
    assert a != b and a.startswith("localhost/jaxlab-test-base:")
    assert a == base_image_tag("http://a.example/debian")


@pytest.fixture
def image_root(tmp_path: Path) -> Path:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\njaxlab:x:10001:10001::/home/jaxlab:/bin/sh\n"
    )
    (tmp_path / "etc" / "group").write_text("root:x:0:\njaxlab:x:10001:\nstaff:x:50:\n")
    return tmp_path


def test_image_user_resolves_as_the_engine_does(image_root):
    assert image_user(image_root, "10001") == (10001, 10001, "/home/jaxlab")
    assert image_user(image_root, "jaxlab") == (10001, 10001, "/home/jaxlab")
    assert image_user(image_root, "jaxlab:staff") == (10001, 50, "/home/jaxlab")
    assert image_user(image_root, "4242:7") == (4242, 7, "/")  # no passwd entry
    assert image_user(image_root, "") == (0, 0, "/root")
    with pytest.raises(AssertionError, match="no such user"):
        image_user(image_root, "nobody-here")


def test_inside_refuses_a_path_through_a_symlink(image_root):
    (image_root / "var").mkdir()
    (image_root / "var" / "run").symlink_to("/run")  # absolute: it would lead onto the host
    assert inside(image_root, "/etc/passwd") == image_root / "etc" / "passwd"
    with pytest.raises(AssertionError, match="symlink"):
        inside(image_root, "/var/run/data")


def test_run_dir_argument():
    assert run_dir_argument(["jaxlab", "serve", "--run-dir", "/run"]) == "/run"
    assert run_dir_argument(["jaxlab", "serve", "--run-dir=/data"]) == "/data"
    with pytest.raises(AssertionError, match="no --run-dir"):
        run_dir_argument(["jaxlab", "serve"])
