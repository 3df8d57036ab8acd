"""A graph as text, as JSON-able data and as Graphviz DOT, and its rendering to SVG."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestr.errors import ConfigError

if TYPE_CHECKING:
    from ._graph import Graph, GraphNode
    from ._items import Batched

__all__ = ["describe", "render", "to_dict", "to_dot"]


def _choice(node: GraphNode) -> str:
    choice = node.choice
    if callable(choice):
        return getattr(choice, "__qualname__", type(choice).__name__)
    return choice


def _source_kind(items: Any) -> str:
    if hasattr(items, "__aiter__"):
        return f"async iterable ({type(items).__name__})"
    if hasattr(items, "__len__"):
        return f"{type(items).__name__} of {len(items)} items"
    return f"iterable ({type(items).__name__})"


def _batch(inlet: Batched) -> str:
    parts = []
    if inlet.count is not None:
        parts.append(f"count={inlet.count}")
    if inlet.timeout_s is not None:
        parts.append(f"timeout_s={inlet.timeout_s:g}")
    return f"batch({', '.join(parts)})" if parts else ""


def _inlet(inlet: Batched) -> str:
    batch = _batch(inlet)
    return f"{inlet.node.name}.{batch}" if batch else inlet.node.name


def node_dict(node: GraphNode) -> dict[str, Any]:
    """One node's declaration as JSON-able data."""
    out: dict[str, Any] = {"name": node.name, "kind": node.kind, "capacity": node.capacity}
    out["inputs"] = [
        {"node": i.node.name, "batch_count": i.count, "batch_timeout_s": i.timeout_s}
        for i in node.inputs
    ]
    if node.kind == "source":
        out["items"] = _source_kind(node.items)
    if node.endpoint is not None:
        out.update(
            mesh=node.endpoint.mesh.name,
            endpoint=node.endpoint.name,
            members=node.mesh_size,
            ordered=node.ordered,
            inflight_per_member=node.inflight_per_member,
            retries=node.retries,
            retry_timeout_s=node.retry_timeout_s,
        )
        if node.kind == "map":
            out["choice"] = _choice(node)
        if node.staleness is not None:
            out["staleness"] = {"eta": node.staleness.eta, "policy": node.staleness.policy}
        if node.version_of is not None:
            out["version_of"] = _name(node.version_of)
    return out


def to_dict(graph: Graph) -> dict[str, Any]:
    outputs = {name: node.name for name, node in graph.outputs.items()}
    out = {"name": graph.name, "nodes": [node_dict(n) for n in graph.nodes], "outputs": outputs}
    if graph.output_staleness:
        out["output_staleness"] = {
            name: {"eta": bound.eta, "policy": bound.policy}
            for name, bound in graph.output_staleness.items()
        }
    return out


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def _output(graph: Graph, name: str) -> str:
    bound = graph.output_staleness.get(name)
    return f" (staleness eta={bound.eta} {bound.policy})" if bound is not None else ""


def _detail(node: GraphNode) -> str:
    if node.kind == "source":
        return f"source, {_source_kind(node.items)}"
    if node.kind == "input":
        return "input, one value per step (compiled)"
    if node.kind == "merge":
        return f"merge of {', '.join(i.node.name for i in node.inputs)}"
    ep = node.endpoint
    assert ep is not None
    what = f"{node.kind} {ep.mesh.name}.{ep.name} on {node.mesh_size} member(s)"
    opts = [f"<- {_inlet(node.inputs[0])}"]
    if node.kind == "map":
        opts.append(f"choice {_choice(node)}")
    opts.append(f"{node.inflight_per_member} in flight per member")
    opts.append("ordered" if node.ordered else "unordered")
    if node.staleness is not None:
        opts.append(f"staleness eta={node.staleness.eta} {node.staleness.policy}")
    if node.version_of is not None:
        opts.append(f"version_of {_name(node.version_of)}")
    opts.append(f"retries {node.retries} within {node.retry_timeout_s:g} s")
    return f"{what} {', '.join(opts)}"


def describe(graph: Graph) -> str:
    nodes = graph.nodes
    outputs = graph.outputs
    lines = [f"graph {graph.name!r}: {len(nodes)} node(s), {len(outputs)} output(s)"]
    width = max((len(n.name) for n in nodes), default=0)
    for node in nodes:
        lines.append(f"  {node.name:<{width}}  {_detail(node)}; capacity {node.capacity}")
    for name, node in outputs.items():
        source = f" <- {node.name}" if name != node.name else ""
        lines.append(f"  output {name}{source}{_output(graph, name)}")
    return "\n".join(lines)


def _q(text: str) -> str:
    """A DOT string literal (json escaping is a superset of what DOT needs)."""
    return json.dumps(text)


def _label(node: GraphNode) -> str:
    if node.kind == "source":
        return f"{node.name}\nsource: {_source_kind(node.items)}"
    if node.kind == "input":
        return f"{node.name}\ninput per step"
    if node.kind == "merge":
        return f"{node.name}\nmerge"
    ep = node.endpoint
    assert ep is not None
    lines = [node.name, f"{node.kind} {ep.mesh.name}.{ep.name} x{node.mesh_size}"]
    if node.kind == "map":
        lines.append(f"{_choice(node)}, {node.inflight_per_member}/member")
    else:
        lines.append(f"{node.inflight_per_member}/member")
    if node.staleness is not None:
        lines.append(f"staleness {node.staleness.eta} ({node.staleness.policy})")
    return "\n".join(lines)


_SHAPES = {
    "source": "cylinder",
    "input": "cds",
    "map": "box",
    "fanout": "box3d",
    "merge": "invtriangle",
}


def to_dot(graph: Graph) -> str:
    out = [f"digraph {_q(graph.name)} {{", "  rankdir=LR;"]
    out.append('  node [fontname="Helvetica", fontsize=11];')
    out.append('  edge [fontname="Helvetica", fontsize=9];')
    for node in graph.nodes:
        out.append(f"  {_q(node.name)} [shape={_SHAPES[node.kind]}, label={_q(_label(node))}];")
    for node in graph.nodes:
        for inlet in node.inputs:
            label = [f"cap {inlet.node.capacity}"]
            if _batch(inlet):
                label.insert(0, _batch(inlet))
            if inlet.node.kind in ("map", "fanout"):
                label.append("ordered" if inlet.node.ordered else "unordered")
            out.append(
                f"  {_q(inlet.node.name)} -> {_q(node.name)} [label={_q(chr(10).join(label))}];"
            )
    for name, node in graph.outputs.items():
        sink = f"output:{name}"
        note = f"output {name}{_output(graph, name)}"
        out.append(f"  {_q(sink)} [shape=note, label={_q(note)}];")
        out.append(f"  {_q(node.name)} -> {_q(sink)} [style=dashed];")
    out.append("}")
    return "\n".join(out) + "\n"


def render(graph: Graph, prefix: str | Path) -> tuple[Path, Path]:
    base = Path(prefix)
    dot_path = base.with_name(base.name + ".dot")
    svg_path = base.with_name(base.name + ".svg")
    dot_path.write_text(to_dot(graph), encoding="utf-8")
    dot = shutil.which("dot")
    if dot is None:
        raise ConfigError(
            f"Graphviz's `dot` is not on PATH, so {svg_path} was not drawn ({dot_path} was "
            f"written); install Graphviz (apt-get install graphviz, brew install graphviz) "
            f"or open the .dot file elsewhere"
        )
    try:
        subprocess.run(
            [dot, "-Tsvg", str(dot_path), "-o", str(svg_path)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"`dot -Tsvg {dot_path}` failed: {exc.stderr.strip()}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"`dot -Tsvg {dot_path}` took over 60 s; the graph is too big") from exc
    return dot_path, svg_path
