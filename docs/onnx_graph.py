"""Draw an exported ONNX graph one box per Relax binding (the nodes' doc strings name it), with matplotlib.

    python docs/onnx_graph.py EXPORT/decode.onnx docs/onnx-decode-graph.png [TITLE]

Graphviz is not needed (Netron opens the .onnx files themselves; this is for a picture in the README). Boxes are
ranked by their longest path from the graph's inputs; each says the Relax op and the ONNX ops it became.
"""
from __future__ import annotations

import sys
from collections import OrderedDict


def main(src: str, dst: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import onnx

    graph = onnx.load(src, load_external_data=False).graph
    groups: OrderedDict[str, list] = OrderedDict()
    for i in graph.input:
        groups[f"in:{i.name}"] = []
    for node in graph.node:
        if node.op_type == "Identity" and node.output[0] in {o.name for o in graph.output}:
            continue
        key = node.doc_string.split(": ", 1)[-1] or node.op_type
        groups.setdefault(key, []).append(node)
    for o in graph.output:
        groups[f"out:{o.name}"] = []
    producer = {i.name: f"in:{i.name}" for i in graph.input}
    for key, nodes in groups.items():
        for node in nodes:
            for out in node.output:
                producer[out] = key
    renames = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity"}
    edges = set()
    for key, nodes in groups.items():
        for node in nodes:
            for name in node.input:
                if name in producer and producer[name] != key:
                    edges.add((producer[name], key))
    for o in graph.output:
        if renames.get(o.name) in producer:
            edges.add((producer[renames[o.name]], f"out:{o.name}"))
    rank = {}
    for key in groups:                                     # groups are in topological order (graph order)
        rank[key] = max([rank[a] + 1 for a, b in edges if b == key and a in rank], default=0)
    for o in graph.output:                                 # outputs on the last row
        rank[f"out:{o.name}"] = max(rank.values()) + 1 if o.name == "logits" else rank[f"out:{o.name}"]
    rows: dict[int, list[str]] = {}
    for key in groups:
        rows.setdefault(rank[key], []).append(key)
    width = max(len(r) for r in rows.values())
    fig, ax = plt.subplots(figsize=(2.3 * width + 1, 0.62 * len(rows) + 1), dpi=110)
    pos = {}
    for r, keys in rows.items():
        for j, key in enumerate(keys):
            pos[key] = ((j - (len(keys) - 1) / 2) * 2.3, -r * 0.62)
    for a, b in edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate("", xy=(x1, y1 + 0.2), xytext=(x0, y0 - 0.2),
                    arrowprops=dict(arrowstyle="->", color="#888888", lw=0.7))
    for key, (x, y) in pos.items():
        nodes = groups[key]
        if key.startswith(("in:", "out:")):
            label, color = key.split(":", 1)[1], "#e8e8e8"
        else:
            op = key.split(" = ", 1)[-1].replace("relax.", "")
            kinds = list(OrderedDict.fromkeys(n.op_type for n in nodes))
            detail = " ".join(kinds[:4]) + (" ..." if len(kinds) > 4 else "")
            label = f"{op}\n{len(nodes)}: {detail}" if len(nodes) > 1 else f"{op}\n{detail}"
            color = "#ffe0b0" if op.startswith("sharpi.") else "#d8e8ff"
        ax.text(x, y, label, ha="center", va="center", fontsize=6.5,
                bbox=dict(boxstyle="round,pad=0.3", fc=color, ec="#666666", lw=0.6))
    xs = [p[0] for p in pos.values()]
    ax.set_xlim(min(xs) - 1.3, max(xs) + 1.3)
    ax.set_ylim(-(len(rows) - 1) * 0.62 - 0.5, 0.5)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(*sys.argv[1:])
