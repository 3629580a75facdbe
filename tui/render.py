"""Colours for exit depth: early exits warm (cheap), full depth cool."""

from __future__ import annotations

from rich.text import Text

# A ramp from the shallowest exit (orange: most compute saved) to full depth (blue).
_RAMP = [(255, 170, 60), (250, 225, 90), (120, 220, 120), (90, 190, 230), (130, 140, 255)]


def depth_color(exit_layer: int, num_layers: int) -> str:
    f = min(max(exit_layer / max(num_layers, 1), 0.0), 1.0)
    x = f * (len(_RAMP) - 1)
    i = min(int(x), len(_RAMP) - 2)
    t = x - i
    r, g, b = (round(a + (c - a) * t) for a, c in zip(_RAMP[i], _RAMP[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


def token_text(piece: str, exit_layer: int, num_layers: int, drafted: bool, source: str | None = None) -> Text:
    """A drafted token is underlined, and italic too when prompt lookup copied it from the context."""
    style = depth_color(exit_layer, num_layers) + (" underline" if drafted else "")
    return Text(piece, style=style + (" italic" if drafted and source == "lookup" else ""))


def legend(depths: list[int], num_layers: int) -> Text:
    out = Text("exit depth  ")
    for d in depths:
        out.append(f" L{d} ", style=f"black on {depth_color(d, num_layers)}")
        out.append(" ")
    out.append("  underlined = accepted draft", style="underline")
    out.append(", italic = copied by prompt lookup", style="italic underline")
    return out
