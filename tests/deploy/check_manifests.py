"""Checks a rendered kvsidecar overlay for what the pod must have, beyond schema validity.

    check_manifests.py OVERLAY RENDERED.yaml DEPLOY_DIR

OVERLAY is "cpu", "gpu" or "shared-tier" (other overlays get the common checks). Prints every problem found and
exits 1 if there is any.
"""
import os
import sys

import yaml

problems = []


def check(condition, message):
    if not condition:
        problems.append(message)
    return condition


def containers_by_name(pod):
    return {c["name"]: c for c in pod.get("containers", [])}


def mounts(container):
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def env(container):
    return {e["name"]: e for e in container.get("env", [])}


def example_keys(deploy_dir):
    """Dotted keys of deploy/kvsidecar.example.yaml, or None if it does not exist yet."""
    path = os.path.join(deploy_dir, "kvsidecar.example.yaml")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    keys = set()

    def walk(prefix, node):
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and key != "quotas":
                walk(dotted + ".", value)
            else:
                keys.add(dotted)

    walk("", doc)
    return keys


def check_shared_tier(by_kind, sidecar, volumes):
    """The Redis Cluster of the shared tier and the sidecar pointed at it."""
    args = sidecar.get("args", [])
    remote = [a for a in args if a.startswith("--remote_tier=")]
    check(len(remote) == 1 and remote[0].startswith("--remote_tier=redis://"),
          "shared-tier: the sidecar has no --remote_tier=redis://... argument")
    password = [a.split("=", 1)[1] for a in args
                if a.startswith("--remote_tier_password_file=")]
    check(len(password) == 1, "shared-tier: no --remote_tier_password_file argument")
    secrets = {s["metadata"]["name"] for s in by_kind.get("Secret", [])}
    if password:
        mount = next((m for m in sidecar.get("volumeMounts", [])
                      if password[0].startswith(m["mountPath"].rstrip("/") + "/")), None)
        volume = volumes.get(mount["name"], {}) if mount else {}
        check(volume.get("secret", {}).get("secretName") in secrets,
              "shared-tier: the Redis password file is not from a rendered Secret")
    sets = [s for s in by_kind.get("StatefulSet", []) if "redis" in s["metadata"]["name"]]
    if check(len(sets) == 1, "shared-tier: no Redis StatefulSet"):
        redis = sets[0]
        check(redis["spec"].get("replicas") == 6,
              "shared-tier: the Redis StatefulSet does not run 6 nodes (3 masters + replicas)")
        services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
        service = services.get(redis["spec"].get("serviceName"), {})
        check(service.get("spec", {}).get("clusterIP") == "None",
              "shared-tier: the Redis StatefulSet has no headless Service")
        for host in remote[0].split("//", 1)[1].split(",") if remote else []:
            check(host.split(":")[0].split(".")[1:2] == [redis["spec"].get("serviceName")],
                  f"shared-tier: seed node {host} is not a pod of the Redis StatefulSet")
    jobs = [j for j in by_kind.get("Job", [])
            if "--cluster create" in " ".join(
                " ".join(c.get("command", []) + c.get("args", []))
                for c in j["spec"]["template"]["spec"]["containers"])]
    check(len(jobs) == 1, "shared-tier: no Job running redis-cli --cluster create")


def main():
    overlay, rendered, deploy_dir = sys.argv[1:4]
    with open(rendered) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    for kind in ("Deployment", "ConfigMap", "Secret", "NetworkPolicy", "ServiceAccount"):
        check(kind in by_kind, f"no {kind} rendered")
    if problems:
        return
    deployment = by_kind["Deployment"][0]
    template = deployment["spec"]["template"]
    pod = template["spec"]
    annotations = template["metadata"].get("annotations", {})
    check(annotations.get("prometheus.io/scrape") == "true", "no prometheus.io/scrape annotation")
    check(annotations.get("prometheus.io/path") == "/metrics", "prometheus.io/path is not /metrics")

    # The sidecar is a native sidecar (Kubernetes 1.29+): an init container with restartPolicy
    # Always, so it starts (and passes its startup probe) before the worker and stops after it.
    regular = containers_by_name(pod)
    init = {c["name"]: c for c in pod.get("initContainers", [])}
    check(set(regular) == {"model-worker"},
          f"containers are {sorted(regular)}, expected model-worker alone")
    check("kvsidecar" in init, "kvsidecar is not an init container (native sidecar)")
    check(init.get("kvsidecar", {}).get("restartPolicy") == "Always",
          "the kvsidecar init container has no restartPolicy: Always (native sidecar)")
    # Init containers start in order; one before the sidecar would delay it and has to finish.
    check(list(init)[:1] == ["kvsidecar"], f"init containers are {list(init)}, kvsidecar not first")
    containers = {**init, **regular}
    sidecar = containers.get("kvsidecar", {})
    worker = containers.get("model-worker", {})
    metrics_port = annotations.get("prometheus.io/port")
    check(any(str(p["containerPort"]) == metrics_port for p in sidecar.get("ports", [])),
          f"prometheus.io/port {metrics_port} is not a port of the sidecar")

    # Security: non-root, no privilege, read-only root file systems.
    pod_security = pod.get("securityContext", {})
    check(pod_security.get("runAsNonRoot") is True, "pod securityContext.runAsNonRoot is not true")
    check(pod_security.get("runAsUser", 0) != 0, "pod runs as uid 0")
    check(not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"),
          "pod uses a host namespace")
    for name, container in containers.items():
        security = container.get("securityContext", {})
        check(security.get("privileged") is not True, f"{name} is privileged")
        check(security.get("allowPrivilegeEscalation") is False,
              f"{name} allows privilege escalation")
        check("ALL" in security.get("capabilities", {}).get("drop", []),
              f"{name} does not drop all capabilities")
        check(security.get("readOnlyRootFilesystem") is True,
              f"{name} has a writable root file system")
        resources = container.get("resources", {})
        for part in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                check(resource in resources.get(part, {}), f"{name} has no {part}.{resource}")

    # gRPC probes on the data port; readiness on the Sidecar service (NOT_SERVING when draining).
    data_port = 50051
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        grpc = sidecar.get(probe, {}).get("grpc")
        if check(grpc is not None, f"kvsidecar {probe} is not a gRPC probe"):
            check(grpc.get("port") == data_port, f"kvsidecar {probe} is not on port {data_port}")
    check(sidecar.get("readinessProbe", {}).get("grpc", {}).get("service") ==
          "kvsidecar.v1.Sidecar", "readiness does not check the kvsidecar.v1.Sidecar service")
    pre_stop = sidecar.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    check("drain" in pre_stop, "the sidecar's preStop does not drain it")
    # The preStop drain moves live sequences to a tier, then waits for the worker; the drain at
    # SIGTERM (drain.grace) follows. All of it must fit before the kubelet's SIGKILL.
    def seconds_of(prefix):
        values = [a[len(prefix):] for a in pre_stop if a.startswith(prefix)]
        return float(values[0]) if values else None
    hook_grace = seconds_of("--grace=")
    hook_wait = seconds_of("--wait-timeout=") if "--wait" in pre_stop else 0
    check(any(a.startswith("--to=") for a in pre_stop),
          "the sidecar's preStop drain does not move live sequences to a tier (--to=)")

    # Shared memory: one Memory emptyDir at /dev/shm in both containers.
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    shm_names = {mounts(c).get("/dev/shm") for c in (sidecar, worker)}
    check(len(shm_names) == 1 and None not in shm_names,
          "the two containers do not share one /dev/shm volume")
    shm = volumes.get(next(iter(shm_names)), {}) if len(shm_names) == 1 else {}
    check(shm.get("emptyDir", {}).get("medium") == "Memory",
          "/dev/shm is not an emptyDir with medium Memory")

    # The Unix socket the sidecar hands arena descriptors over: one emptyDir at /run/kvsidecar in
    # both containers, and the sidecar told to listen there.
    run_names = {mounts(c).get("/run/kvsidecar") for c in (sidecar, worker)}
    check(len(run_names) == 1 and None not in run_names,
          "the two containers do not share one /run/kvsidecar volume")
    run = volumes.get(next(iter(run_names)), {}) if len(run_names) == 1 else {}
    check("emptyDir" in run, "/run/kvsidecar is not an emptyDir")
    check("--arena_socket=/run/kvsidecar/private/arena.sock" in sidecar.get("args", []),
          "the sidecar is not started with --arena_socket=/run/kvsidecar/private/arena.sock")

    # Configuration from the ConfigMap, secrets from the Secret.
    config_maps = {c["metadata"]["name"]: c for c in by_kind["ConfigMap"]}
    config_volume = volumes.get(mounts(sidecar).get("/etc/kvsidecar/kvsidecar.yaml"), {})
    config_map = config_maps.get(config_volume.get("configMap", {}).get("name"))
    if check(config_map is not None, "the sidecar's config volume names no rendered ConfigMap"):
        config = yaml.safe_load(config_map["data"]["kvsidecar.yaml"])
        check("--config=/etc/kvsidecar/kvsidecar.yaml" in sidecar.get("args", []),
              "the sidecar is not started with --config")
        check(config.get("listen", "").endswith(f":{data_port}"),
              f"config listen is not on the probed port {data_port}")
        check(config.get("metrics_listen", "").endswith(f":{metrics_port}"),
              "config metrics_listen is not the scraped port")
        expected_backend = {"cpu": "cpu", "gpu": "cuda"}.get(overlay)
        if expected_backend:
            check(config.get("backend") == expected_backend,
                  f"config backend is {config.get('backend')}, expected {expected_backend}")
        if overlay == "cpu":
            check(config.get("shm_dir") == "/dev/shm", "the CPU arena is not in /dev/shm")
        known = example_keys(deploy_dir)
        if known is not None:
            flat = set()
            for key, value in config.items():
                if isinstance(value, dict) and key != "quotas":
                    flat.update(f"{key}.{k}" for k in value)
                else:
                    flat.add(key)
            unknown = sorted(flat - known)
            check(not unknown, f"config keys not in deploy/kvsidecar.example.yaml: {unknown}")
        drain = config.get("drain", {})
        check(drain.get("to") in ("disk", "remote"),
              f"config drain.to is {drain.get('to')}: SIGTERM would drop live sequences")
        grace = str(drain.get("grace", "25s"))
        grace_s = float(grace[:-2]) / 1000 if grace.endswith("ms") else (
            float(grace[:-1]) if grace.endswith("s") else float(grace))
        budget = pod.get("terminationGracePeriodSeconds", 30)
        if check(hook_grace is not None, "the sidecar's preStop drain has no --grace="):
            check(hook_grace + (hook_wait or 0) + grace_s < budget,
                  f"preStop --grace ({hook_grace}s) + --wait-timeout ({hook_wait}s) + "
                  f"drain.grace ({grace_s}s) do not fit terminationGracePeriodSeconds ({budget})")
        if overlay == "shared-tier":
            check(drain.get("to") == "remote", "shared-tier: drain.to is not remote")
            check("--to=remote" in pre_stop, "shared-tier: the preStop drain is not --to=remote")
        for key in ("admin_token_file", "tenant_tokens_file"):
            path = config.get("auth", {}).get(key, "")
            check(path.startswith("/etc/kvsidecar/secrets/"),
                  f"auth.{key} is not read from the mounted Secret")
    secret_names = {s["metadata"]["name"] for s in by_kind["Secret"]}
    secrets_volume = volumes.get(mounts(sidecar).get("/etc/kvsidecar/secrets"), {})
    check(secrets_volume.get("secret", {}).get("secretName") in secret_names,
          "the sidecar's secrets volume names no rendered Secret")
    tls_volume = volumes.get(mounts(sidecar).get("/etc/kvsidecar/tls"), {})
    check(tls_volume.get("secret", {}).get("optional") is True,
          "no optional TLS Secret volume at /etc/kvsidecar/tls")

    if overlay == "shared-tier":
        check_shared_tier(by_kind, sidecar, volumes)

    gpu_holders = [name for name, c in containers.items()
                   if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
    if overlay == "gpu":
        check(pod.get("shareProcessNamespace") is True, "GPU pod without shareProcessNamespace")
        check(gpu_holders == ["kvsidecar"],
              f"nvidia.com/gpu is requested by {gpu_holders}, expected by kvsidecar alone")
        check(str(sidecar["resources"]["limits"].get("nvidia.com/gpu")) == "1",
              "the sidecar does not request exactly one GPU")
        check(env(worker).get("NVIDIA_VISIBLE_DEVICES", {}).get("value") is not None,
              "the worker does not see the GPU (NVIDIA_VISIBLE_DEVICES)")
    else:
        check(not gpu_holders, f"{overlay} overlay requests a GPU")


if __name__ == "__main__":
    main()
    for problem in problems:
        print(f"  problem: {problem}", file=sys.stderr)
    sys.exit(1 if problems else 0)
