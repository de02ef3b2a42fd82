"""Pictures of attention weights with matplotlib (optional: ``pip install matplotlib``).

``sdpa.inspect`` makes whole reports without matplotlib; this is for drawing weights into
figures of your own."""

import numpy as np


def heatmap(weights, ax=None, *, log=False, cmap="viridis", blocked_color="0.75", colorbar=True):
    """Draws one head's weights (Nq, Nk) as a heatmap on ``ax`` (a new figure's axes when None)
    and returns the AxesImage. Query rows run down, keys across, as ``sdpa inspect`` draws them;
    ``log`` colours log10 of the weights; weights exactly 0 (blocked keys) are drawn in
    ``blocked_color``, apart from small weights. Any leading dims must be 1 (pass one head)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("sdpa.plot needs matplotlib: pip install matplotlib") from e
    w = np.asarray(weights, dtype=np.float64)
    while w.ndim > 2 and w.shape[0] == 1:
        w = w[0]
    if w.ndim != 2:
        raise ValueError(f"weights must be one head's (Nq, Nk) (leading dims of 1 are dropped), got shape {np.shape(weights)}")
    if ax is None:
        ax = plt.figure().add_subplot()
    shown = np.ma.masked_equal(w, 0.0)
    if log:
        with np.errstate(divide="ignore"):
            shown = np.ma.log10(shown)
    colours = plt.get_cmap(cmap).with_extremes(bad=blocked_color)
    image = ax.imshow(shown, cmap=colours, aspect="auto", interpolation="nearest")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, label="log10 weight" if log else "weight")
    return image
