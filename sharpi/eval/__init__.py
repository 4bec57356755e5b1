"""Long-context accuracy: prompt builders, scoring, resumable sweeps over budget, length and depth, plots and
a Markdown report (`sharpi eval`)."""
