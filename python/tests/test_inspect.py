"""``sdpa.inspect`` and ``sdpa inspect``: the report's heatmaps decoded back and compared with
the weights (exact and block-averaged), the toy head's 2×3 weights with their values, the page
rendered by a real headless browser (Debian's chromium: images of the expected size, not
blank), sdpa.plot.heatmap, errors."""

import base64
import io
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import sdpa

# CI installs Pillow, matplotlib and chromium (scripts/setup.sh): there their absence fails.
_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
PIL = __import__("PIL.Image").Image if _CI else pytest.importorskip("PIL.Image")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _images(html):
    """The report's heatmaps: (alt, width, height, RGB array) per <img>."""
    out = []
    for alt, w, h, data in re.findall(r"<img class='heatmap' alt='([^']*)' width='(\d+)' height='(\d+)' "
                                      r"src='data:image/png;base64,([^']*)'>", html):
        img = PIL.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
        assert img.size == (int(w), int(h))
        out.append((alt, int(w), int(h), np.asarray(img)))
    return out


def test_toy_head_shows_its_weights_with_values():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    k = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    v = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    report = sdpa.inspect(q, k, v, progress=False)
    w = sdpa.attention(q, k, v, return_weights=True)[1]
    html = report._repr_html_()
    for x in w.ravel():  # every weight, 6 significant digits, in the values table
        assert f"<td>{x:.6g}</td>" in html
    (alt, width, height, lin), (_, _, _, log) = _images(html)
    assert (width, height) == (3 * 48, 2 * 48)  # 48 pixels per cell
    # The linear picture orders the cells as the weights: brighter (viridis) = larger.
    cells = lin[24::48, 24::48].astype(float).sum(-1).ravel()
    assert np.all(np.diff(cells[np.argsort(w.ravel(), kind="stable")]) >= 0)
    assert cells.max() > cells.min()


def test_long_inputs_get_block_averages():
    rng = np.random.default_rng(0)
    Nq, Nk = 300, 2600
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((Nq, 16), (Nk, 16), (Nk, 16)))
    mask = np.ones((Nq, Nk), bool)
    mask[:, 1000:1300] = False  # a blocked band: grey cells
    report = sdpa.inspect(q, k, v, mask, causal=True, cells=100, progress=False)
    (alt, width, height, lin), _ = _images(report.html)
    assert (width, height) == (600, 600)  # 100 x 100 cells of 6 pixels
    grey = np.all(lin == 190, axis=-1)
    band = grey[:, 1000 * 100 // Nk * 6 + 6:1300 * 100 // Nk * 6 - 6]
    assert band.all()
    assert not grey[:, :6].any()  # key 0 is seen by every row


def test_save_writes_the_same_page(tmp_path):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    report = sdpa.inspect(q, k, v, progress=False)
    path = tmp_path / "r.html"
    report.save(path)
    assert path.read_text(encoding="utf-8") == report.html
    assert "batch 0, head 1" in report.html


@pytest.mark.parametrize("arg,value", [("topk", 33), ("cells", 0), ("max_heads", -1), ("topk", 1.5)])
def test_bad_arguments_name_themselves(arg, value):
    with pytest.raises(ValueError, match=arg):
        sdpa.inspect(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), **{arg: value})


def test_errors_of_the_call_name_the_argument():
    with pytest.raises(ValueError, match="Dk"):
        sdpa.inspect(np.ones((2, 4)), np.ones((3, 5)), np.ones((3, 4)))


@pytest.mark.skipif(CHROMIUM is None and not _CI, reason="chromium is not installed")
def test_a_real_browser_renders_the_report(tmp_path):
    """`sdpa inspect --demo` writes the page; headless chromium renders it to a screenshot whose
    pictures have their size and are not blank."""
    assert CHROMIUM, "CI: scripts/setup.sh installs Debian's chromium"
    exe = shutil.which("sdpa", path=os.path.dirname(sys.executable)) or "sdpa"
    page = tmp_path / "demo.html"
    subprocess.run([exe, "inspect", "--demo", "-o", str(page)], check=True)
    html = page.read_text()
    assert "seed 000" in html
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                    "--force-device-scale-factor=1", "--force-color-profile=srgb", f"--screenshot={shot}",
                    "--window-size=900,1400", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    img = np.asarray(PIL.open(shot).convert("RGB"))
    assert img.shape[:2] == (1400, 900)
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20  # not blank: text, tables, pictures
    # The two 144 x 96 heatmaps are on screen: find the linear one's 6 cells by their colours.
    (_, w, h, lin), _ = _images(html)
    colours = {tuple(lin[y, x]) for y in (24, 72) for x in (24, 72, 120)}
    on_screen = {tuple(c) for c in img.reshape(-1, 3)}
    assert colours <= on_screen
    for c in colours:  # each colour fills at least a cell's area (48 x 48 pixels, less borders)
        assert np.all(img == np.array(c, np.uint8), axis=-1).sum() >= 40 * 40


def test_plot_heatmap():
    plt = __import__("matplotlib.pyplot").pyplot if _CI else pytest.importorskip("matplotlib.pyplot")
    import matplotlib
    matplotlib.use("Agg")
    from sdpa import plot
    w = sdpa.attention(np.eye(3), np.eye(3), np.eye(3), np.tril(np.ones((3, 3), bool)), return_weights=True)[1]
    image = plot.heatmap(w, log=True)
    arr = image.get_array()
    assert arr.mask[0, 1] and arr.mask[0, 2] and not arr.mask[1, 0]  # blocked keys drawn apart
    assert np.allclose(arr[1, 1], np.log10(w[1, 1]))
    plt.close("all")
    with pytest.raises(ValueError, match="one head"):
        plot.heatmap(np.ones((2, 3, 3)))
