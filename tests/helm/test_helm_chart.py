"""The Helm chart (helm/m3serve), offline: lint, render, validate every object, and load its serve config.

helm-python-sdk embeds Helm v4's Go SDK (libhelm_c through ctypes): lint, schema validation and rendering run
in-process with no helm binary and no cluster. Core objects are checked strictly with kubernetes-validate; the
RayService and PodMonitor against the CRD schema subsets beside this file (their sources are noted inside).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import typing
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from deploy.config import GroupConfig, ServeConfig, load_serve_config
from workers.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "m3serve"
HERE = Path(__file__).resolve().parent
CI_SETS = sorted(p.stem for p in (CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "llm"
# The chart's minimum Kubernetes (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.26.0", kv.latest_version())


def ci_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / f"{name}.yaml").read_text()) or {}


@functools.lru_cache(maxsize=None)
def _render_cached(values_json: str) -> dict[str, list[dict[str, Any]]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return {Path(k).name: [d for d in yaml.safe_load_all(v) if d] if k.endswith(".yaml") else v
            for k, v in out.items()}


def render(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Template name -> parsed documents (NOTES.txt stays text)."""
    return _render_cached(json.dumps(values or {}, sort_keys=True))


def objects(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Rendered objects by kind (each kind appears at most once in this chart)."""
    out: dict[str, dict[str, Any]] = {}
    for name, docs in render(values).items():
        if name.endswith(".txt"):
            continue
        for doc in docs:
            assert doc["kind"] not in out, f"{doc['kind']} rendered twice"
            out[doc["kind"]] = doc
    return out


def serve_doc(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return yaml.safe_load(objects(values)["RayService"]["spec"]["serveConfigV2"])


def app_args(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (app,) = serve_doc(values)["applications"]
    return app["args"]


def worker_groups(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    specs = objects(values)["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return {g["groupName"]: g for g in specs}


# ------------------------------------------------------------------------------------------------ lint / render
@pytest.mark.parametrize("ci", CI_SETS)
def test_lint_is_clean_for_every_ci_value_set(ci):
    report = helm.lint(CHART, ci_values(ci), strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert not problems and not report["errors"], problems or report["errors"]


def test_lint_is_clean_with_the_default_values():
    report = helm.lint(CHART, None, strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2], report
    assert objects()["RayService"]["metadata"]["name"] == f"{RELEASE}-m3serve"


def test_the_three_ci_value_sets_exist():
    assert set(CI_SETS) >= {"unified-1gpu", "pd-4p4d", "tp8"}


@pytest.mark.parametrize("ci", CI_SETS)
def test_every_ci_value_set_renders_the_expected_objects(ci):
    values = ci_values(ci)
    kinds = set(objects(values))
    want = {"RayService", "PodMonitor", "ScrapeConfig", "PrometheusRule", "ConfigMap"}
    if values.get("apiKey", {}).get("value"):
        want.add("Secret")
    assert kinds == want
    assert "port-forward svc/demo-m3serve-serve" in render(values)["NOTES.txt"]


# --------------------------------------------------------------------------------------- object validation
def _pod_template(group: dict[str, Any], name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": group["template"]}


def _core_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    objs = objects(values)
    rs = objs["RayService"]["spec"]
    svc = {"apiVersion": "v1", "kind": "Service", **rs["serveService"]}
    found = [svc, _pod_template(rs["rayClusterConfig"]["headGroupSpec"], "head")]
    found += [_pod_template(g, g["groupName"]) for g in rs["rayClusterConfig"]["workerGroupSpecs"]]
    found += [objs[k] for k in ("ConfigMap", "Secret") if k in objs]
    return found


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("ci", CI_SETS)
def test_core_objects_validate_strictly(ci, kube):
    """Service (the RayService's serveService), ConfigMap, Secret and every pod template (as a PodTemplate)."""
    for obj in _core_objects(ci_values(ci)):
        try:
            kv.validate(obj, kube, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {'.'.join(map(str, e.path))}: {e.message}")


def test_strict_validation_catches_a_misspelled_field():
    """The check above can fail: a typo inside a pod template is rejected."""
    (svc, head, *_rest) = _core_objects(ci_values("tp8"))
    head = json.loads(json.dumps(head))
    head["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError, match="volumeMount"):
        kv.validate(head, KUBE_VERSIONS[-1], strict=True)


def _schema(name: str) -> jsonschema.Draft7Validator:
    schema = json.loads((HERE / name).read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("ci", CI_SETS)
def test_rayservice_validates_against_the_kuberay_v1_schema(ci):
    values = ci_values(ci)
    rs = objects(values)["RayService"]
    errors = sorted(_schema("kuberay_rayservice_v1.schema.json").iter_errors(rs), key=str)
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    # What the KubeRay operator checks beyond the schema: unique group names, min <= replicas <= max, and every
    # rayStartParams value is a string (a map[string]string in Go).
    groups = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups)
    for g in groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())


def test_kuberay_schema_rejects_unknown_fields():
    rs = json.loads(json.dumps(objects(ci_values("tp8"))["RayService"]))
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    assert not _schema("kuberay_rayservice_v1.schema.json").is_valid(rs)


@pytest.mark.parametrize("ci", CI_SETS)
def test_podmonitor_scrapes_ray_metrics_on_every_pod(ci):
    values = ci_values(ci)
    objs = objects(values)
    pm = objs["PodMonitor"]
    errors = list(_schema("podmonitor_v1.schema.json").iter_errors(pm))
    assert not errors, [e.message for e in errors]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    rc = objs["RayService"]["spec"]["rayClusterConfig"]
    pods = [rc["headGroupSpec"]] + rc["workerGroupSpecs"]
    for group in pods:
        # Every Ray pod is selected and exports on the named port that Ray writes its metrics to.
        labels = group["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == 8080 == int(group["rayStartParams"]["metrics-export-port"])


# ------------------------------------------------------------------------------------ serve config round trip
@pytest.mark.parametrize("ci", CI_SETS)
def test_api_metrics_are_scraped_once_through_the_serve_service(ci):
    """The API port's /metrics holds every replica's series: one target, the serve Service, not each pod."""
    values = ci_values(ci)
    objs = objects(values)
    sc, svc = objs["ScrapeConfig"]["spec"], objs["RayService"]["spec"]["serveService"]
    port = svc["spec"]["ports"][0]["port"]
    assert sc["metricsPath"] == "/metrics"
    assert sc["staticConfigs"] == [{"targets": [f"{svc['metadata']['name']}.{NAMESPACE}.svc:{port}"]}]


@pytest.mark.parametrize("ci", CI_SETS)
def test_serve_config_v2_is_a_valid_ray_serve_config(ci):
    from ray.serve.schema import ServeDeploySchema

    doc = serve_doc(ci_values(ci))
    parsed = ServeDeploySchema.model_validate(doc) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(doc)
    (app,) = parsed.applications
    assert app.import_path == "deploy.app:build_app"
    assert parsed.http_options.host == "0.0.0.0" and parsed.http_options.port == 8000


# Beyond the ci sets: attention-DP and several replicas, so tp * dp * replicas is not just tp.
EXTRA_LAYOUTS = {"unified-tp2-dp2-x3": {"serve": {"unified": {"replicas": 3, "tp": 2, "dp": 2, "ep": 4}}},
                 "pd-tp2-dp2-x2": {"serve": {"disaggregate": True, "prefill": {"replicas": 2, "tp": 2, "dp": 1, "ep": 2},
                                             "decode": {"replicas": 2, "tp": 2, "dp": 2, "ep": 4}}}}


def layout_values(name: str) -> dict[str, Any]:
    return EXTRA_LAYOUTS[name] if name in EXTRA_LAYOUTS else ci_values(name)


@pytest.mark.parametrize("ci", CI_SETS + sorted(EXTRA_LAYOUTS))
def test_serve_config_loads_and_matches_the_worker_groups(ci):
    values = layout_values(ci)
    args = app_args(values)
    assert set(args) == {"config"}
    cfg = load_serve_config(args["config"])
    assert cfg.api_key is None  # the key travels in a Secret, never in the RayService
    groups = worker_groups(values)
    assert set(groups) == set(cfg.groups())
    for role, group in cfg.groups().items():
        pod = groups[role]["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        # One pod per engine replica; its GPUs are the replica's tp * dp shards: tp * dp * replicas in the group.
        assert groups[role]["replicas"] == group.replicas
        assert limits["nvidia.com/gpu"] * groups[role]["replicas"] == group.tp * group.dp * group.replicas
        assert int(groups[role]["rayStartParams"]["num-gpus"]) == group.tp * group.dp
        # KubeRay's form for custom resources: a JSON object inside a quoted string (it goes to a shell).
        assert json.loads(json.loads(groups[role]["rayStartParams"]["resources"])) == {f"m3serve_{role}": group.tp * group.dp}
        # The engines find the checkpoint where the chart mounts it.
        mount = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert cfg.model.startswith(mount["model"] + "/")
        # NCCL's shared memory: a memory-backed /dev/shm with an explicit size.
        assert mount["dshm"] == "/dev/shm"
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"].endswith("Gi")
    # Values the chart passes through unchanged.
    want = values["serve"]
    for key in ("device", "disaggregate", "model_name"):
        if key in want:
            assert getattr(cfg, key) == want[key], key
    for key, val in want.get("engine", {}).items():
        assert getattr(cfg.engine, key) == val, key


@pytest.mark.parametrize("ci", CI_SETS)
def test_build_app_accepts_the_rendered_args(ci, tmp_path):
    """deploy.app.build_app builds the Serve application in-process (no Ray cluster, no GPU).

    build_app checks that the checkpoint directory exists, so the chart is rendered with its model mount moved to a
    temporary directory holding the built-in tiny checkpoint; everything else is the ci value set as is.
    """
    app_module = pytest.importorskip("deploy.app")
    from ray.serve import Application
    from workers.models import tiny_model_dir

    values = json.loads(json.dumps(ci_values(ci)))
    model = values.setdefault("model", {})
    sub = model.get("subPath") or "model"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / sub).symlink_to(tiny_model_dir(), target_is_directory=True)
    model["mountPath"] = str(tmp_path / "models")
    args = app_args(values)
    assert args["config"]["model"] == str(tmp_path / "models" / sub)
    app = app_module.build_app(args)
    assert isinstance(app, Application)
    # The chart's per-deployment options name exactly the deployments the app has (Serve rejects a config that
    # names a deployment the application lacks). Ray's own builder resolves the graph without a cluster.
    from ray.serve._private.build_app import build_app as resolve_deployments

    built = resolve_deployments(app, name=serve_doc(values)["applications"][0]["name"])
    (rendered_app,) = serve_doc(values)["applications"]
    assert {d["name"] for d in rendered_app["deployments"]} == {d.name for d in built.deployments}


# ------------------------------------------------------------------------------------------------ dashboard
def test_dashboard_configmap_carries_the_chart_copy():
    cm = objects()["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    chart_copy = json.loads((CHART / "dashboards" / "m3serve.json").read_text())
    assert json.loads(cm["data"]["m3serve.json"]) == chart_copy
    assert chart_copy["title"] and isinstance(chart_copy["panels"], list)


def test_chart_dashboard_is_a_copy_of_the_metrics_dashboard():
    """helm/m3serve/dashboards/m3serve.json must be a byte copy of deploy/dashboards/m3serve.json (.Files.Get can
    only read inside the chart)."""
    source = REPO / "deploy" / "dashboards" / "m3serve.json"
    if not source.is_file():
        pytest.skip("deploy/dashboards/m3serve.json does not exist yet (metrics issue)")
    assert (CHART / "dashboards" / "m3serve.json").read_bytes() == source.read_bytes(), \
        "copy deploy/dashboards/m3serve.json to helm/m3serve/dashboards/m3serve.json"


@pytest.mark.parametrize("ci", CI_SETS)
def test_prometheus_rule_carries_the_recording_rules(ci):
    rule = objects(ci_values(ci))["PrometheusRule"]
    errors = list(_schema("prometheusrule_v1.schema.json").iter_errors(rule))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    chart_copy = yaml.safe_load((CHART / "prometheus" / "m3serve.rules.yml").read_text())
    assert rule["spec"]["groups"] == chart_copy["groups"]


def test_chart_rules_are_a_copy_of_the_metrics_rules():
    source = REPO / "deploy" / "prometheus" / "m3serve.rules.yml"
    if not source.is_file():
        pytest.skip("deploy/prometheus/m3serve.rules.yml does not exist yet (metrics issue)")
    assert (CHART / "prometheus" / "m3serve.rules.yml").read_bytes() == source.read_bytes(), \
        "copy deploy/prometheus/m3serve.rules.yml to helm/m3serve/prometheus/m3serve.rules.yml"


# ----------------------------------------------------------------------------------- API key / Secret
def test_api_key_value_creates_a_secret_and_reaches_every_ray_container():
    objs = objects(ci_values("unified-1gpu"))
    secret = objs["Secret"]
    key_ref = {"name": secret["metadata"]["name"], "key": "api-key"}
    assert "ci-test-key" not in json.dumps(objs["RayService"])
    rc = objs["RayService"]["spec"]["rayClusterConfig"]
    for group in [rc["headGroupSpec"]] + rc["workerGroupSpecs"]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["M3SERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == key_ref


def test_existing_secret_is_referenced_and_not_created():
    objs = objects(ci_values("pd-4p4d"))
    assert "Secret" not in objs
    head = objs["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    assert env["M3SERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "m3serve-api-key", "key": "token"}


def test_no_api_key_means_no_secret_and_no_env():
    objs = objects(ci_values("tp8"))
    assert "Secret" not in objs
    assert "M3SERVE_API_KEY" not in json.dumps(objs["RayService"])


# ------------------------------------------------------------------------------ wrong values fail early
BAD_VALUES = [
    ({"serve": {"unified": {"replicas": -1}}}, "/serve/unified/replicas", "minimum"),
    ({"serve": {"prefill": {"replicas": 0}}}, "/serve/prefill/replicas", "minimum"),
    ({"serve": {"unified": {"tp": 0}}}, "/serve/unified/tp", "minimum"),
    ({"serve": {"decode": {"ep": 0}}}, "/serve/decode/ep", "minimum"),
    ({"serve": {"unified": {"dp": -2}}}, "/serve/unified/dp", "minimum"),
    ({"serve": {"unified": {"tp": "8"}}}, "/serve/unified/tp", "integer"),
    ({"serve": {"device": "tpu"}}, "/serve/device", "'cuda', 'cpu'"),
    ({"workerGroups": {"verifier": {"shmSize": "8Gi"}}}, "/workerGroups", "verifier"),
    ({"serve": {"engine": {"dtype": "int4"}}}, "/serve/engine/dtype", "bfloat16"),
    ({"serve": {"engine": {"max_tokens": 10}}}, "/serve/engine", "max_tokens"),
    ({"serve": {"engine": {"gpu_memory_utilization": 1.5}}}, "/serve/engine/gpu_memory_utilization", "maximum"),
    ({"serve": {"api_key": "s3cret"}}, "/serve", "api_key"),
    ({"model": {"source": "nfs"}}, "/model/source", "pvc"),
    ({"model": {"source": "pvc", "pvc": {"claimName": ""}}}, "/model/pvc/claimName", "minLength"),
    ({"model": {"source": "objectStorage"}}, "/model/objectStorage/uri", "pattern"),
    ({"service": {"port": 0}}, "/service/port", "minimum"),
    ({"rayService": {"upgradeStrategy": "Rolling"}}, "/rayService/upgradeStrategy", "NewCluster"),
]


@pytest.mark.parametrize("bad,path,reason", BAD_VALUES, ids=[p + ":" + r for _, p, r in BAD_VALUES])
def test_wrong_values_fail_at_schema_time_naming_the_key(bad, path, reason):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as err:
            chart.validate_schema(chart.merge_values(bad))
        with pytest.raises(helm.HelmError):  # install/template refuses them as well
            chart.render(bad, name=RELEASE, namespace=NAMESPACE)
    message = str(err.value)
    assert path in message and reason in message, message


def test_the_schema_accepts_every_ci_value_set_and_the_defaults():
    with helm.Chart.load(CHART) as chart:
        for ci in CI_SETS:
            chart.validate_schema(chart.merge_values(ci_values(ci)))
        chart.validate_schema(chart.merge_values({}))


CROSS_FIELD = [
    ({"gracefulShutdown": {"serveTimeoutSeconds": 300}}, "serveTimeoutSeconds must be below terminationGracePeriodSeconds"),
    ({"serve": {"unified": {"tp": 4, "dp": 1, "ep": 3}}}, "serve.unified.ep: 3 must divide tp * dp = 4"),
    ({"serve": {"unified": {"tp": 8, "dp": 2, "ep": 1}}}, "exceeds workerGroups.unified.maxGpusPerPod = 8"),
    ({"apiKey": {"value": "a", "existingSecret": "b"}}, "either apiKey.value or apiKey.existingSecret"),
    ({"serve": {"drain_grace_s": 61}}, "rayStopGraceSeconds must be below terminationGracePeriodSeconds"),
]


@pytest.mark.parametrize("bad,message", CROSS_FIELD,
                         ids=["drain-vs-grace", "ep-divides", "pod-gpus", "api-key-twice", "ingress-drain-vs-grace"])
def test_cross_field_mistakes_stop_the_render_with_a_clear_message(bad, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError, match=message.replace("*", r"\*").replace(".", r"\.")):
            chart.render(bad, name=RELEASE, namespace=NAMESPACE)


# ------------------------------------------------------------------------- the schema tracks ServeConfig
def _literal_values(tp: Any) -> list[Any] | None:
    return list(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else None


def _assert_mirrors(schema: dict[str, Any], cls: type, where: str, skip: frozenset[str] = frozenset()) -> None:
    fields = {f.name for f in dataclasses.fields(cls)} - skip
    assert set(schema["properties"]) == fields, f"{where}: schema {sorted(schema['properties'])} != {sorted(fields)}"
    assert schema.get("additionalProperties") is False, where
    hints = typing.get_type_hints(cls)
    for name in fields:
        sub = schema["properties"][name]
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            _assert_mirrors(sub, tp, f"{where}.{name}")
        elif (lits := _literal_values(tp)) is not None:
            assert sorted(sub["enum"]) == sorted(lits), f"{where}.{name}"


def test_values_schema_mirrors_serve_config():
    """values.serve is ServeConfig minus api_key (Secret) and http (owned by the chart): a new field or enum value
    in deploy/config.py or workers/config.py fails here until the chart knows it."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    _assert_mirrors(schema["properties"]["serve"], ServeConfig, "serve", frozenset({"api_key", "http"}))
    for role in ("unified", "prefill", "decode"):
        _assert_mirrors(schema["properties"]["serve"]["properties"][role], GroupConfig, f"serve.{role}")
    _assert_mirrors(schema["properties"]["serve"]["properties"]["engine"], EngineConfig, "serve.engine")
    assert schema["properties"]["workerGroups"]["propertyNames"]["enum"] == ["unified", "prefill", "decode"]


def test_default_values_render_a_loadable_serve_config():
    cfg = load_serve_config(app_args()["config"])
    assert cfg.groups()["unified"].parallel.world_size == 8
    assert cfg.model == "/models/minimax-m3"


def test_builtin_tiny_cpu_layout_requests_no_gpus():
    values = {"serve": {"device": "cpu", "model_name": None}, "model": {"source": "builtinTiny"}}
    cfg = load_serve_config(app_args(values)["config"])
    assert cfg.model is None and cfg.device == "cpu"
    (group,) = worker_groups(values).values()
    assert group["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in json.dumps(group["template"]["spec"]["containers"][0]["resources"])


# ------------------------------------------------------------------------------ preStop: drain, then stop Ray
def _pre_stop(container: dict[str, Any]) -> str:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"], command
    return command[2]


@pytest.mark.parametrize("ci", CI_SETS)
def test_worker_pods_drain_their_ingress_before_ray_stops(ci):
    """Each worker pod's preStop drains its ingress replica(s) through POST /admin/drain (deploy/drain_hook.py)
    with the app's grace period, then stops Ray; the two fit the pod's termination grace period. The head holds no
    replica (num-cpus 0): it only stops Ray. The pod's IP reaches the hook, which names it to the route."""
    values = ci_values(ci)
    g = {"rayStopGraceSeconds": 120, "terminationGracePeriodSeconds": 180, **values.get("gracefulShutdown", {})}
    grace = values.get("serve", {}).get("drain_grace_s", 30)
    spec = objects(values)["RayService"]["spec"]
    prefix = values.get("serveApp", {}).get("routePrefix", "/")
    for group in spec["rayClusterConfig"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        hook = _pre_stop(container)
        drain, stop = hook.split("; ")
        assert drain.startswith("python -m deploy.drain_hook ") and f"--grace {grace}" in drain, hook
        assert f"--port {container['ports'][0]['containerPort']}" in drain and f"--prefix {prefix}" in drain, hook
        assert stop == f"ray stop --grace-period {g['rayStopGraceSeconds']}", hook
        assert grace + g["rayStopGraceSeconds"] < pod["terminationGracePeriodSeconds"]
        env = {e["name"]: e for e in container["env"]}
        assert env["M3SERVE_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert _pre_stop(head) == f"ray stop --grace-period {g['rayStopGraceSeconds']}"


def test_drain_hook_can_be_turned_off():
    (group,) = worker_groups({"gracefulShutdown": {"drainIngress": False}}).values()
    hook = _pre_stop(group["template"]["spec"]["containers"][0])
    assert hook == "ray stop --grace-period 120" and "drain_hook" not in hook


def test_drain_hook_module_is_what_the_chart_runs():
    """The hook the chart names exists and takes the flags the chart passes."""
    from deploy import drain_hook

    (group,) = worker_groups().values()
    drain = _pre_stop(group["template"]["spec"]["containers"][0]).split("; ")[0]
    assert vars(drain_hook.parse_args(drain.split()[3:])) == {"port": 8000, "prefix": "/", "grace": 30.0,
                                                               "calls": 2}
