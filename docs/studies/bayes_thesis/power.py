"""Power of configs/studies/bayes_thesis.yaml, from its pilot
(configs/studies/bayes_thesis_pilot.yaml).

  python docs/studies/bayes_thesis/power.py   # reads pilot_runs.csv beside this file

For each pre-registered comparison at depth 4: the s.d. of the paired differences of the
primary endpoint (mean log2 KL over steps 999-1499 in the 1500-step pilot) and, for n seeds, the
difference a paired t test detects with 80% power at the Holm first-step level 0.05/3
(noncentral t), and the seeds the pilot's own mean difference would need.
"""

import math
import pathlib

import numpy as np
import pandas as pd
from scipy import optimize, stats

HERE = pathlib.Path(__file__).parent
ALPHA, POWER = 0.05 / 3, 0.8


def power(delta_over_sd: float, n: int, alpha: float = ALPHA) -> float:
  df, nc = n - 1, delta_over_sd * math.sqrt(n)
  t = stats.t.ppf(1 - alpha / 2, df)
  lower = stats.nct.cdf(-t, df, nc)  # the wrong-sign rejections: negligible, NaN far out
  return stats.nct.sf(t, df, nc) + (0.0 if math.isnan(lower) else lower)


def mde(sd: float, n: int) -> float:
  return sd * optimize.brentq(lambda e: power(e, n) - POWER, 1e-6, 4)


def seeds_needed(delta: float, sd: float) -> int:
  n = 3
  while power(abs(delta) / sd, n) < POWER and n < 10_000:
    n += 1
  return n


def main() -> None:
  df = pd.read_csv(HERE / "pilot_runs.csv")
  steps = [c for c in df.columns if c.startswith("kl_bits@") and 999 <= int(c.split("@")[1])]
  df["endpoint"] = np.log2(df[steps]).mean(axis=1)
  wide = df.pivot(index="seed", columns="arm", values="endpoint")
  print(f"pilot: {len(wide)} seeds at depth 4; endpoint = mean log2 KL over {steps}")
  for a, b in [("hc", "mhc"), ("mhc", "residual"), ("mhc", "mhc_identity"), ("hc", "residual")]:
    d = wide[a] - wide[b]
    sd = d.std(ddof=1)
    print(
      f"{a:>4} - {b:<12} mean {d.mean():+.2f} sd {sd:.2f} (log2 units) | 80% power at "
      f"alpha {ALPHA:.4f}: n=8 detects {mde(sd, 8):.2f} ({2 ** mde(sd, 8):.1f}x KL), "
      f"n=16 {mde(sd, 16):.2f} ({2 ** mde(sd, 16):.1f}x) | the pilot's own mean needs "
      f"{seeds_needed(d.mean(), sd)} seeds"
    )


if __name__ == "__main__":
  main()
