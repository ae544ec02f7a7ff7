"""deploy/'s Kubernetes manifests: each valid against Kubernetes' own schema (strict: no field
the API does not know), and wired as charrun and the image expect: the arguments parse with
charrun's and charbuild's real command lines, the probes reach /healthz and /readyz on the
--health-port the container exposes, the grace period outlasts --grace-period, the engine is
mounted read-only where the image's entrypoint reads it, the LiveKit credentials come from
the Secret's keys, the GPU is requested, and the user is the image's."""

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="needs PyYAML (pip install '.[test]')")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (pip install '.[test]')")

from charengine.builder.build_config import find_target  # noqa: E402
from charengine.builder.cli import main as charbuild  # noqa: E402
from charengine.runtime.cli import main as charrun  # noqa: E402
from charengine.runtime.run_config import LIVEKIT_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = "1.31"  # the API version the manifests are held to
GPU = "nvidia.com/gpu"
EXIT_MARGIN_S = (5, 60)  # terminationGracePeriodSeconds - --grace-period: at least, at most


def documents() -> list[tuple[str, dict]]:
    return [(f"{p.name}:{i}", d) for p in sorted(DEPLOY.glob("*.yaml"))
            for i, d in enumerate(yaml.safe_load_all(p.read_text())) if d]


def one(kind: str, file: str) -> dict:
    found = [d for name, d in documents() if d["kind"] == kind and name.startswith(file)]
    assert len(found) == 1, f"{file} holds {len(found)} {kind}s"
    return found[0]


def image_entrypoint() -> list[str]:
    text = (ROOT / "Containerfile").read_text()
    return json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M).group(1))


def image_user() -> tuple[int, int]:
    """The uid and gid of the image's USER line (build arguments read at their defaults)."""
    text = (ROOT / "Containerfile").read_text()
    user = re.findall(r"^USER\s+(\S+)\s*$", text, re.M)[-1]

    def value(part: str) -> int:
        arg = re.fullmatch(r"\$\{?(\w+)\}?", part)
        if arg:
            part = re.search(rf"^ARG {arg.group(1)}=(\S+)\s*$", text, re.M).group(1)
        return int(part)

    uid, _, gid = user.partition(":")
    return value(uid), value(gid or uid)


def parsed(command, args: list[str]) -> dict:
    """The parameters a click command takes from `args` (its own parser: an unknown flag or a
    bad value raises)."""
    return command.make_context(command.name or "cmd", list(args)).params


def port_of(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def mounts(container: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


@pytest.fixture
def deployment():
    return one("Deployment", "deployment.yaml")


@pytest.fixture
def worker(deployment):
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "charrun"]
    return pod, container, parsed(charrun, image_entrypoint()[1:] + container["args"])


def test_every_manifest_is_valid_against_the_kubernetes_schema():
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Secret", "Job",
                                           "PersistentVolumeClaim"}
    for name, d in docs:
        try:
            kubernetes_validate.validate(d, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_schema_check_refuses_a_misspelt_or_missing_field(deployment):
    """Control: the validation above can fail."""
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)
    del deployment["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def test_the_deployment_selects_its_own_pods(deployment):
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= labels.items()


def test_the_worker_runs_charrun_livekit_through_the_images_entrypoint(worker):
    pod, container, params = worker
    assert "command" not in container  # the image's `charrun --engine /engine`
    assert params["livekit"] and not params["serve"]
    assert params["host"] == "0.0.0.0"  # the kubelet probes the pod's address
    assert container["image"].endswith(":gpu")


def test_the_probes_reach_healthz_and_readyz_on_the_health_port(worker):
    pod, container, params = worker
    live, ready = container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]
    assert live["path"] == "/healthz" and ready["path"] == "/readyz"
    assert port_of(container, live["port"]) == port_of(container, ready["port"]) \
        == params["health_port"]
    assert "startupProbe" not in container  # /healthz answers from before the engine loads


def test_metrics_are_scraped_from_the_probe_server(deployment, worker):
    _, _, params = worker
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == params["health_port"]
    assert notes["prometheus.io/path"] == "/metrics"


def test_the_grace_period_outlasts_charruns_drain(worker):
    pod, container, params = worker
    margin = pod["terminationGracePeriodSeconds"] - params["grace_period"]
    assert EXIT_MARGIN_S[0] <= margin <= EXIT_MARGIN_S[1], margin
    assert "lifecycle" not in container  # no preStop: charrun drains on SIGTERM itself


def test_the_engine_is_mounted_read_only_where_the_entrypoint_reads_it(worker):
    pod, container, params = worker
    engine = str(params["engine_dir"])
    mount = mounts(container)[engine]
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    if "emptyDir" in volume:  # the init route: a copy onto the pod's disk, made before charrun
        (init,) = [c for c in pod["initContainers"]
                   if any(m["name"] == mount["name"] for m in c["volumeMounts"])]
        target = next(m for m in init["volumeMounts"] if m["name"] == mount["name"])
        assert not target.get("readOnly")
        assert init["command"][0] == "cp" and init["command"][-1].rstrip("/") \
            == target["mountPath"].rstrip("/")
        assert init["command"][-2].startswith(engine)  # the engine image's engine, at /engine
    else:
        assert volume["persistentVolumeClaim"]["readOnly"] is True


def test_the_livekit_credentials_come_from_the_secrets_keys(worker):
    pod, container, _ = worker
    secret = one("Secret", "secret.yaml")
    env = {e["name"]: e for e in container["env"]}
    for name in LIVEKIT_ENV:
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in secret["stringData"]
        assert "value" not in env[name]


def test_the_worker_requests_one_gpu_and_runs_as_the_images_user(worker):
    pod, container, _ = worker
    res = container["resources"]
    assert res["limits"][GPU] == res["requests"][GPU] == 1
    assert "memory" in res["limits"] and "cpu" in res["requests"]
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert (ctx["runAsUser"], ctx["runAsGroup"]) == image_user() == (10001, 10001)
    for c in [container, *pod.get("initContainers", [])]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    if container["securityContext"].get("readOnlyRootFilesystem"):
        assert not mounts(container)["/tmp"].get("readOnly")  # charrun's temporary files
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" and
               mounts(container).get("/dev/shm", {}).get("name") == v["name"]
               for v in pod["volumes"])


def test_the_engine_build_job_runs_charbuild_into_the_shared_volume(deployment):
    job = one("Job", "engine-volume.yaml")
    claim = one("PersistentVolumeClaim", "engine-volume.yaml")["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["charbuild"]
    params = parsed(charbuild, container["args"])
    target = find_target(params["target_name"])
    assert target.device == "cuda" and not params["no_kernels"]  # compiled on its GPU
    assert container["resources"]["limits"][GPU] >= 1
    engines = next(v["name"] for v in pod["volumes"]
                   if v.get("persistentVolumeClaim", {}).get("claimName") == claim)
    mount = next(m for m in container["volumeMounts"] if m["name"] == engines)
    assert str(params["out"]).startswith(mount["mountPath"] + "/")
    assert not mount.get("readOnly")
    worker_pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == worker_pod["nodeSelector"]  # the GPU the workers run on
    assert target.gpu in pod["nodeSelector"]["nvidia.com/gpu.product"]
