#!/usr/bin/env bash
# The Secrets the manifests read, in the current namespace: one per Redis user, each with a
# random password, and Redis's ACL file holding only the SHA-256 hashes of those passwords
# (the Redis pod never sees a password). The users are docs/SECURITY.md's roles:
#
#   elastic-redis-agent-NAME  ec-agent-NAME: the agents of the Job NAME, on that Job's keys only
#   elastic-redis-viewer      ec-viewer: reads every job (console.yaml's `serve`)
#   elastic-redis-operator    ec-operator: reads every job, writes commands (your console)
#   elastic-redis-admin       ec-admin: every command, for people maintaining Redis; no pod
#   elastic-redis-acl         users.acl: all of the above; a client without credentials may
#                             only PING (the default user: the readiness probe)
#
#   bash secrets.sh [NAME ...]      # the Jobs' names; default: train train-static
#
# To add a Job, run it again with every Job's name, the old ones too: existing passwords are
# kept, the ACL file is written anew from the names given. A running Redis takes the new file
# on an ACL LOAD once the kubelet has refreshed the mounted Secret (within a minute or two):
#   kubectl exec -it elastic-redis-0 -- redis-cli --user ec-admin --askpass ACL LOAD
set -euo pipefail

[ $# -gt 0 ] || set -- train train-static
for name in "$@"; do
    # A Job's name is a DNS label: nothing in it is a glob or a separator in an ACL rule.
    if ! [[ $name =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]]; then
        echo "secrets.sh: $name is not a Job name (lower-case letters, digits and '-')" >&2
        exit 2
    fi
done

# The password in Secret $1 (key "password"), made first if the Secret does not exist.
password() {
    if ! kubectl get secret "$1" >/dev/null 2>&1; then
        kubectl create secret generic "$1" --from-literal=password="$(openssl rand -hex 24)" \
            >/dev/null
    fi
    kubectl get secret "$1" -o jsonpath='{.data.password}' | base64 -d
}

# What Redis keeps of a password: the hex SHA-256 of its bytes (an ACL rule's #HASH).
hashed() {
    local pw
    pw=$(password "$1")
    printf %s "$pw" | openssl dgst -sha256 | sed 's/^.*= //'
}

# A job id the agents of Job NAME use: NAME-<the Job's uid> (agents.yaml's --job-id), so the
# agent user's keys are those of that shape, whatever uid the Job gets when it is applied.
uid='????????-????-????-????-????????????'

umask 077
acl=$(mktemp)
trap 'rm -f "$acl"' EXIT
# Each hash in a variable first: a failure inside $(...) in an echo's arguments would not stop
# the script, and an ACL file with an empty hash would lock that user out.
admin=$(hashed elastic-redis-admin)
operator=$(hashed elastic-redis-operator)
viewer=$(hashed elastic-redis-viewer)
{
    echo "user default on nopass resetkeys resetchannels -@all +ping"
    echo "user ec-admin on #$admin ~* &* +@all"
    echo "user ec-operator on #$operator resetkeys %R~elastic:* %W~elastic:{*}:commands" \
         "resetchannels -@all +@read +@connection +time +xadd +acl|whoami +acl|dryrun -@dangerous"
    echo "user ec-viewer on #$viewer resetkeys %R~elastic:* resetchannels -@all +@read" \
         "+@connection +time +acl|whoami +acl|dryrun -@dangerous"
    for name in "$@"; do
        agent=$(hashed "elastic-redis-agent-$name")
        job="$name-$uid"
        echo "user ec-agent-$name on #$agent resetkeys ~elastic:{$job}:*" \
             "~elastic:log:{$job/*}:* resetchannels -@all +@read +@write +@scripting" \
             "+@transaction +@connection +time -@dangerous (~elastic:jobs +zadd)"
    done
} >"$acl"
kubectl create secret generic elastic-redis-acl --from-file=users.acl="$acl" \
    --dry-run=client -o yaml | kubectl apply -f - >/dev/null
echo "secrets.sh: Secrets elastic-redis-acl, -admin, -operator, -viewer and" \
     "$(printf -- '-agent-%s ' "$@")are ready"
