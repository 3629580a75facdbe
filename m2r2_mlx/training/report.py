"""What a training run prints at the end, the same for both trainers (no mlx here: the PyTorch trainer prints it
where mlx is not installed)."""

from __future__ import annotations


def agreement_table(metrics: dict) -> str:
    """One line per gate: the held-out top-1 agreement with the full model of the layerskip exit and the fast stream's
    (evaluate.gate_agreement's dict), and on answer and text tokens only where the rows had a loss mask."""
    lines = []
    scored = metrics.get("scored")
    for j, g in enumerate(metrics["gates"]):
        line = (
            f"gate L{g}: layerskip {100 * metrics['layerskip'][j]:.1f}%  fast {100 * metrics['fast'][j]:.1f}%  "
            f"(top-1 agreement with the full model, {metrics['tokens']} held-out tokens)"
        )
        if scored:
            line += (
                f"; answers and text only: {100 * scored['layerskip'][j]:.1f}% / {100 * scored['fast'][j]:.1f}% "
                f"({scored['tokens']})"
            )
        lines.append(line)
    return "\n".join(lines)
