"""The package's layers, as a contract over its import graph: every import points down this list
(or stays inside its own package), and no module reaches itself through its imports."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Top to bottom. A module may import its own package and anything in a lower layer; packages that
# share a layer are independent of each other. Imports inside functions count too.
LAYERS = [
    ("nanovllm.__init__", "nanovllm.ray_data", "nanovllm.testing", "nanovllm.serve",
     "nanovllm.lm_eval"),
    ("nanovllm.llm",),            # the front: validation and outputs, for one engine or many
    ("nanovllm.ray",),            # data parallel: engine replicas as Ray actors
    ("nanovllm.engine",),         # requests, scheduler, block manager: the step loop on rank 0
    ("nanovllm.runner",),         # one rank: model, KV pool, graphs, step inputs
    ("nanovllm.config",),         # engine options, checked once
    ("nanovllm.models",),         # the registry and the decoders
    ("nanovllm.layers", "nanovllm.sampling"),
    ("nanovllm.checkpoint",),     # safetensors, hub ids, GGUF, tokenizer, config.json
    ("nanovllm.kernels",),        # Triton only
    ("nanovllm.step",),           # the step's messages between the engine, runner and sampler
    ("nanovllm.sampling_params", "nanovllm.extras", "nanovllm.outputs", "nanovllm.inputs"),
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts)


def component(module: str) -> tuple[int, str]:
    """(layer index, package) of a nanovllm module; the package's own __init__ is its own."""
    name = "nanovllm.__init__" if module == "nanovllm" else module
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if name == prefix or name.startswith(prefix + "."):
                return index, prefix
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def imported_modules(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The nanovllm modules `path` imports (a name imported from a package counts as its module
    when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]
        else:
            continue
        found.update(n for n in names if n == "nanovllm" or n.startswith("nanovllm."))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted((ROOT / "nanovllm").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) - {module_name(p)} for p in paths}


def test_every_import_points_down_the_layers():
    upward = []
    for module, imports in import_graph().items():
        layer, package = component(module)
        for target in imports:
            target_layer, target_package = component(target)
            if target_package != package and target_layer <= layer:
                upward.append(f"{module} -> {target}")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles():
    graph = import_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_contract_catches_an_upward_import(tmp_path):
    """The checker itself: sampling importing the runner is refused."""
    source = tmp_path / "probe.py"
    source.write_text("from nanovllm.runner.model_runner import ModelRunner\n")
    modules = {"nanovllm.runner.model_runner"}
    (target,) = imported_modules(source, modules)
    assert component(target)[0] <= component("nanovllm.sampling.sampler")[0]
