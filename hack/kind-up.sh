#!/usr/bin/env bash
# Create a kind cluster with DRA, build and load the image, install the chart in mock mode.
# Needs docker (or podman with KIND_EXPERIMENTAL_PROVIDER=podman), kind >= 0.30, helm, kubectl.
# Not run in CI (no container engine there); the chart itself is tested by tests/test_chart.py.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-dra-accel}
IMAGE=${IMAGE:-dra-accel-driver:dev}
PROFILE=${PROFILE:-mixed}
NODE_IMAGE=${NODE_IMAGE:-kindest/node:v1.34.0}

mkdir -p /tmp/kind-dra-cdi
kind get clusters | grep -qx "$CLUSTER" || \
  kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config hack/kind-cluster.yaml
docker build -t "$IMAGE" .
kind load docker-image --name "$CLUSTER" "$IMAGE"
kubectl create namespace dra-system --dry-run=client -o yaml | kubectl apply -f -
# Privileged pods with host paths (the driver, MPS daemons): see the chart's README.
kubectl label namespace dra-system pod-security.kubernetes.io/enforce=privileged --overwrite
helm upgrade --install dra-accel-driver charts/dra-accel-driver --namespace dra-system \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --set mock.enabled=true --set mock.profile="$PROFILE" --wait
kubectl get resourceslices -o wide
echo "Try: kubectl apply -f examples/gpu-single/claim.yaml && kubectl logs -f pod/gpu-single"
