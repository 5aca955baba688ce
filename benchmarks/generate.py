"""Generate a state directory of S services x E endpoints (ClusterIP; every 10th a NodePort).

    python benchmarks/generate.py OUT_DIR --services 10000 --endpoints 10
"""

from __future__ import annotations

import argparse
import os


def service_yaml(i: int, endpoints: int, ep_offset: int = 0) -> str:
    ns = f"ns{i % 50}"
    name = f"svc{i}"
    ip = f"10.{96 + i // 65000}.{(i // 250) % 256}.{i % 250 + 1}"
    node_port = f"\n      nodePort: {30000 + i // 10}" if i % 10 == 0 and i // 10 < 2700 else ""
    typ = "NodePort" if node_port else "ClusterIP"
    eps = []
    for j in range(endpoints):
        k = i * endpoints + j + ep_offset
        eps.append(f"  - addresses: [10.{128 + k // 65000}.{(k // 250) % 256}.{k % 250 + 1}]\n"
                   f"    conditions: {{ready: true}}\n    nodeName: node-{k % 100}")
    return f"""apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}}}
spec:
  type: {typ}
  clusterIP: {ip}
  ports:
    - name: http
      port: 80
      targetPort: 8080{node_port}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-abcde
  namespace: {ns}
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
""" + "\n".join(eps) + "\n"


def generate(out: str, services: int, endpoints: int) -> None:
    os.makedirs(out, exist_ok=True)
    for i in range(services):
        d = os.path.join(out, f"ns{i % 50}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"svc{i}.yaml"), "w") as fh:
            fh.write(service_yaml(i, endpoints))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--services", type=int, default=1000)
    p.add_argument("--endpoints", type=int, default=10)
    a = p.parse_args()
    generate(a.out, a.services, a.endpoints)


if __name__ == "__main__":
    main()
