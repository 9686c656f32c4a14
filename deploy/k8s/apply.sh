#!/usr/bin/env bash
# Applies an overlay in the order a release needs: the schema migration first, the rest only once
# it has succeeded.
#
#   deploy/k8s/apply.sh prod            # or dev, or the path of an overlay folder
#
# 1. Renders the overlay once (both phases apply the same objects, the Job with the pods' image).
# 2. Deletes the previous release's prediction-migrate Job: Jobs are immutable, and re-running
#    `mlpair migrate` is harmless (idempotent, under an advisory lock).
# 3. Applies the objects labelled app.kubernetes.io/component=migrate (the Job, its ServiceAccount
#    and NetworkPolicy) and waits until the Job is Complete. If it Failed (or outlives
#    MIGRATE_TIMEOUT_S), stops there: nothing else is applied, the running pods keep serving on
#    the schema they know.
# 4. Applies everything else (Deployments, Istio, ...), which rolls the pods.
#
# Argo CD does the same with the PreSync hook annotations of
# deploy/k8s/base/prediction/migrate-job.yaml.
# Environment: KUBECTL (default kubectl), MIGRATE_TIMEOUT_S (900), POLL_S (5).
set -euo pipefail

kubectl=${KUBECTL:-kubectl}
namespace=mlpair
job=prediction-migrate
phase_label=app.kubernetes.io/component
timeout_s=${MIGRATE_TIMEOUT_S:-900}
poll_s=${POLL_S:-5}

overlay=${1:?usage: deploy/k8s/apply.sh <dev|prod|overlay folder>}
if [[ ! -d $overlay ]]; then
  overlay="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/overlays/$overlay"
fi
[[ -d $overlay ]] || { echo "apply.sh: no overlay folder $overlay" >&2; exit 2; }

render=$(mktemp)
trap 'rm -f "$render"' EXIT
"$kubectl" kustomize "$overlay" >"$render"

"$kubectl" -n "$namespace" delete job "$job" --ignore-not-found --cascade=foreground --wait=true
"$kubectl" apply -f "$render" -l "$phase_label=migrate"

deadline=$((SECONDS + timeout_s))
while true; do
  # The conditions that hold; Complete and Failed are final (newer API servers add
  # SuccessCriteriaMet or FailureTarget first).
  state=$("$kubectl" -n "$namespace" get job "$job" \
    -o 'jsonpath={.status.conditions[?(@.status=="True")].type}')
  case " $state " in
    *" Complete "*) break ;;
    *" Failed "*)
      echo "apply.sh: job/$job failed; nothing else was applied." \
        "See: $kubectl -n $namespace logs job/$job -c migrate" >&2
      exit 1 ;;
  esac
  if ((SECONDS >= deadline)); then
    echo "apply.sh: job/$job not complete after ${timeout_s} s; nothing else was applied." >&2
    exit 1
  fi
  sleep "$poll_s"
done
echo "apply.sh: job/$job complete; applying the release"

"$kubectl" apply -f "$render" -l "$phase_label!=migrate"
