"""The graphs a hidden-state drafter needs, from configs alone (what `pegainfer compile` builds and the engines
run): the target's graph giving FEATURES (frontends/features.py) and the head's graphs, as model specs of their
own so each has its manifest (backends/cache.py names them apart)."""

from dataclasses import replace

from pegainfer.errors import ConfigError
from pegainfer.frontends.drafter_load import head_graphs
from pegainfer.frontends.features import FEATURES, with_final_hidden, with_layer_inputs
from pegainfer.frontends.hub import resolve_checkpoint
from pegainfer.frontends.load import LoadedModel, ModelSpec
from pegainfer.runtime.speculative import SpeculativeConfig, parse_speculative_config

FEATURE_METHODS = ("eagle3", "mtp")  # the methods whose drafter reads the target's hidden states


def drafter_graphs(config: SpeculativeConfig, target: ModelSpec) -> tuple[ModelSpec, list[ModelSpec]]:
    """(the target giving the features the method's drafter reads, the head's specs: [first, next], or [one]
    where both are one graph); the target unchanged and no head for a method that reads no features."""
    given = FEATURES in target.graph.outputs  # already the target's features graph
    if config.method == "eagle3":
        head = head_graphs(resolve_checkpoint(config.model).folder, target)
        heads = [head.spec, replace(head.spec, graph=head.next)]
        return target if given else replace(target, graph=with_layer_inputs(target.graph, head.target_layers)), heads
    if config.method == "mtp":
        graph_of = getattr(target.dag, "mtp_graph", None)
        if graph_of is None:
            raise ConfigError(f"--speculative-config: method mtp needs the model's MTP head; {target.architecture} "
                              f"({target.config_path}): its DAG file runs none")
        head = replace(target, graph=graph_of(target.config))
        return target if given else replace(target, graph=with_final_hidden(target.graph)), [head]
    return target, []


def compiled_drafter(config_json: str, specs: list[ModelSpec]) -> list[ModelSpec]:
    """For `pegainfer compile --speculative-config`: the model's specs, its graph giving the features a
    hidden-state drafter reads, then that head's specs (as they are for other methods)."""
    config = parse_speculative_config(config_json)
    if config.method not in FEATURE_METHODS:
        return specs
    refuse_sharded(config, "cuda", len(specs) > 1)
    target, heads = drafter_graphs(config, specs[0])
    return [target, *heads]


def refuse_sharded(config: SpeculativeConfig | None, device: str, sharded: bool) -> None:
    """At start, before ranks are spawned: a hidden-state drafter on the GPU runs beside one rank's engine only."""
    if config is not None and config.method in FEATURE_METHODS and device == "cuda" and sharded:
        raise ConfigError(f"--speculative-config: method {config.method} on cuda runs on one GPU for now "
                          f"(--tensor-parallel-size 1)")


def drafting_target(config: SpeculativeConfig | None, model: LoadedModel, device: str, sharded: bool) -> LoadedModel:
    """What serve and generate run as the target, before its engine: the model giving its drafter's features (a
    sharded CPU model's ranks are given them by make_speculator), refused on several GPUs."""
    refuse_sharded(config, device, sharded)
    return model if sharded else with_drafter_features(config, model)


def with_drafter_features(config: SpeculativeConfig | None, model: LoadedModel) -> LoadedModel:
    """The model whose graph gives the features `config`'s drafter reads (itself for other methods, or where it
    gives them already): made before its engine, which compiles and runs that graph."""
    if config is None or config.method not in FEATURE_METHODS or FEATURES in model.spec.graph.outputs:
        return model
    return replace(model, spec=drafter_graphs(config, model.spec)[0])
