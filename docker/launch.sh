#!/usr/bin/env bash
# Starts a Ray cluster over heterogeneous GPU hosts, one harpjax container per host, each Ray
# node advertising its cluster host name, GPU type and NICs as custom resources; then runs the
# Ray-runtime benchmark (benchmarks/runtime.py cluster) on the head.
#
#   docker/launch.sh up    HOSTS_FILE            # start Ray on every host (head first)
#   docker/launch.sh bench HOSTS_FILE CLUSTER.yaml [benchmark args...]
#   docker/launch.sh down  HOSTS_FILE            # stop and remove the containers
#
# HOSTS_FILE: see docker/hosts.example. Every host needs Docker, the NVIDIA Container Toolkit
# and the image (docker/Dockerfile; IMAGE, default harpjax:gpu); this machine must reach them
# with ssh (SSH, default "ssh"). The cluster file's host names must match HOSTS_FILE's.
#
# The node of host H with N GPUs of type G and NICs n1,n2 advertises the Ray resources
#   harpjax_host:H = 1, harpjax_gpu:G = N, harpjax_nic:n1 = 1, harpjax_nic:n2 = 1.
# harpjax.runtime.ray_runtime places each stage's actor on the node of its host (pin_hosts)
# and finds each NIC's address from the interface of that name on the node.
set -euo pipefail

IMAGE=${IMAGE:-harpjax:gpu}
SSH=${SSH:-ssh}
PORT=${RAY_PORT:-6379}
NAME=harpjax-ray

usage() { sed -n '2,19p' "$0"; exit 1; }
[ $# -ge 2 ] || usage
cmd=$1; hosts_file=$2; shift 2

mapfile -t lines < <(grep -v '^[[:space:]]*#' "$hosts_file" | grep -v '^[[:space:]]*$')
[ ${#lines[@]} -ge 1 ] || { echo "no hosts in $hosts_file" >&2; exit 1; }
read -r _ head_addr _ <<<"${lines[0]}"

resources() {   # host gpu_type count nics -> the --resources JSON
  local host=$1 gpu=$2 n=$3 nics=$4 json nic
  json="{\"harpjax_host:$host\": 1, \"harpjax_gpu:$gpu\": $n"
  IFS=, read -ra list <<<"$nics"
  for nic in "${list[@]}"; do json+=", \"harpjax_nic:$nic\": 1"; done
  echo "$json}"
}

start_node() {   # addr ray-start-arguments (already quoted for the remote shell)
  local addr=$1 args=$2
  # Host networking: the cluster file's NICs are the container's. InfiniBand devices (when the
  # host has them) and unlimited pinned memory for NCCL/RDMA; shared memory for Ray.
  $SSH "$addr" "docker run -d --name $NAME --gpus all --network host --ipc host \
    --shm-size 16g --ulimit memlock=-1 --cap-add IPC_LOCK \
    \$([ -d /dev/infiniband ] && echo --device /dev/infiniband) \
    $IMAGE ray start --block $args"
}

case $cmd in
  up)
    first=1
    for line in "${lines[@]}"; do
      read -r host addr gpu n nics <<<"$line"
      res=$(resources "$host" "$gpu" "$n" "$nics")
      if [ $first = 1 ]; then
        start_node "$addr" "--head --port $PORT --num-gpus $n --include-dashboard false \
          --resources '$res'"
        first=0
        sleep 5
      else
        start_node "$addr" "--address $head_addr:$PORT --num-gpus $n --resources '$res'"
      fi
      echo "started $host on $addr: $n x $gpu, NICs $nics"
    done
    sleep 5
    $SSH "$head_addr" "docker exec $NAME ray status"
    ;;
  bench)
    [ $# -ge 1 ] || usage
    cluster=$1; shift
    # The driver runs in the head's container. It traces on fake CPU devices (the benchmark
    # sets XLA_FLAGS from the cluster file) and needs no GPU of its own; the actors compile
    # and run on their hosts' GPUs.
    tar -C "$(dirname "$cluster")" -c "$(basename "$cluster")" \
      | $SSH "$head_addr" "docker cp - $NAME:/opt/harpjax/"
    $SSH "$head_addr" "docker exec -e JAX_PLATFORMS=cpu $NAME python benchmarks/runtime.py \
      cluster --cluster /opt/harpjax/$(basename "$cluster") --address auto $(printf '%q ' "$@")"
    ;;
  down)
    for line in "${lines[@]}"; do
      read -r host addr _ <<<"$line"
      $SSH "$addr" "docker rm -f $NAME" >/dev/null 2>&1 || true
      echo "stopped $host on $addr"
    done
    ;;
  *) usage ;;
esac
