"""``sdpa.inspect`` and ``sdpa inspect``: the report's heatmaps decoded back and compared with
the weights (exact and block-averaged), the toy head's 2×3 weights with their values, the colour
bars (their values, and the cells' colours read off them), the axis ticks, the page rendered by a
real headless browser (Debian's chromium: images of the expected size, not blank, each colour bar
beside its heatmap), sdpa.plot.heatmap, errors."""

import base64
import html as html_text
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


def _bars(html):
    """The report's colour bars: (alt, top, RGB array) per <img>, in the heatmaps' order."""
    out = []
    for alt, top, w, h, data in re.findall(r"<img class='colourbar' alt='([^']*)' data-top='([^']*)' style='[^']*' "
                                           r"width='(\d+)' height='(\d+)' src='data:image/png;base64,([^']*)'>", html):
        img = PIL.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
        assert img.size == (int(w), int(h))
        out.append((alt, float(top), np.asarray(img)))
    return out


def _texts(html, cls):
    """The texts of the SVG labels of class `cls` (cbar-label, xtick, ytick), per heatmap figure."""
    return [[html_text.unescape(t) for t in re.findall(rf"<text class='{cls}'[^>]*>([^<]*)</text>", fig)]
            for fig in re.findall(r"<figure><figcaption class='axis'>[^<]*scale.*?</figure>", html)]


def _find(img, pattern):
    """The top-left corners (y, x) where `pattern` (h, w, 3) lies in `img`, exactly."""
    h, w = pattern.shape[:2]
    ys, xs = np.nonzero(np.all(img[:img.shape[0] - h + 1, :img.shape[1] - w + 1] == pattern[0, 0], axis=-1))
    return [(y, x) for y, x in zip(ys, xs) if np.array_equal(img[y:y + h, x:x + w], pattern)]


def test_colour_bars_show_the_cells_colours_and_values():
    """One cell per weight (12 x 20, some masked): the linear bar's top is the 99th percentile of
    the weights by nearest rank, the log bar's the largest weight; their labels are 0 .. top in
    quarters and the five decades below the largest; and each cell's colour is the bar's colour at
    the cell's weight, to within the bar's resolution."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((12, 8), (20, 8), (20, 8)))
    mask = rng.random((12, 20)) < 0.8
    w = sdpa.attention(q, k, v, mask, return_weights=True)[1]
    html = sdpa.inspect(q, k, v, mask, progress=False).html
    cells = np.sort(w[w > 0])
    top, largest = cells[-(-99 * cells.size // 100) - 1], cells[-1]
    assert top < largest  # 190-odd cells: rank ceil(0.99 n) is not the last
    (_, _, _, lin), (_, _, _, log) = _images(html)
    (_, lin_top, lin_bar), (_, log_top, log_bar) = _bars(html)
    # The kernel's float64 weights, from attention's weights path and from inspect's pooled one:
    # within a few float64 roundings of each other (softmax over 20 keys).
    assert lin_top == pytest.approx(top, rel=1e-13) and log_top == pytest.approx(largest, rel=1e-13)
    assert _texts(html, "cbar-label") == [
        [f"{x * top:.3g}" for x in (0, 0.25, 0.5, 0.75)] + [f"≥ {top:.3g}"],
        [f"≤ {largest * 1e-5:.3g}"] + [f"{largest * x:.3g}" for x in (1e-4, 1e-3, 1e-2, 1e-1, 1)]]
    px = lin.shape[1] // 20
    with np.errstate(divide="ignore"):
        positions = {"lin": np.clip(w / top, 0, 1), "log": np.clip((np.log10(w / largest) + 5) / 5, 0, 1)}
    for name, picture, bar in (("lin", lin, lin_bar), ("log", log, log_bar)):
        # Bar row y shows position 1 - y / (rows - 1); neighbouring rows differ by at most 8 · 83
        # / (rows - 1) < 1.8 per channel (viridis' steepest knot, 83 of 255 per eighth; 384 rows),
        # so the nearest row's colour is within 0.9 of the cell's before each is rounded to an
        # integer (0.5 each): within 2.
        rows = bar.shape[0]
        assert rows == 12 * px
        cell_rgb = picture[px // 2::px, px // 2::px].astype(int)
        bar_rgb = bar[np.rint((1 - positions[name]) * (rows - 1)).astype(int), bar.shape[1] // 2].astype(int)
        seen = w > 0
        assert np.abs(cell_rgb[seen] - bar_rgb[seen]).max() <= 2, name
        assert np.all(cell_rgb[~seen] == 190)  # grey: no colour of the bar
        assert tuple(bar[0, 0]) == (253, 231, 37) and tuple(bar[-1, 0]) == (68, 1, 84)  # viridis' ends


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
    # Ticks at real indices, though a cell pools 26 keys and 3 rows: steps of 500 keys and 50
    # rows (the smallest round steps that give at most 6 ticks).
    assert _texts(report.html, "xtick")[0] == ["0", "500", "1000", "1500", "2000", "2500"]
    assert _texts(report.html, "ytick")[0] == ["0", "50", "100", "150", "200", "250"]


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
    # Each heatmap is on screen once, and its colour bar just right of it, top-aligned, pixel for
    # pixel (the linear and log bars look alike: take the first right of the heatmap); the bar's
    # top is the largest toy weight's colour (6 cells: the 99th percentile is the largest), and its
    # labels are drawn beside it (dark text pixels).
    assert len(_images(html)) == len(_bars(html)) == 2
    for (_, w, h, heat), (_, _, bar) in zip(_images(html), _bars(html)):
        (y0, x0), = _find(img, heat)
        y1, x1 = min(((y, x) for y, x in _find(img, bar) if y == y0 and x > x0 + w), key=lambda p: p[1])
        assert x1 - (x0 + w) < 40
        assert tuple(bar[0, 0]) == (253, 231, 37) and tuple(bar[0, 0]) in {tuple(c) for c in heat.reshape(-1, 3)}
        beside = img[y1:y1 + bar.shape[0], x1 + bar.shape[1] + 6:x1 + bar.shape[1] + 80].astype(int)
        assert (beside.sum(-1) < 400).sum() > 100


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
