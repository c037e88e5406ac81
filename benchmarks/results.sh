#!/usr/bin/env bash
# Reproduce every comparison table in docs/results/ (offline, CPU, about 1.5 h on
# 2 cores). Each sweep runs methods x seeds with `python -m fedlr.launch.compare run`;
# the runs land in outputs/results/NAME/runs/, and table.md, table.csv,
# comparison.png (and FOT's seed-0 accuracy matrices) are copied to
# docs/results/NAME/. `privacy` runs the lora-family task under DP-SGD at
# epsilon 1, 3 and 6 (its no-DP runs are lora-dirichlet's) and writes the
# privacy table, claims and plot (benchmarks/privacy.py); it is not in the
# default list (about 1 h more on 2 cores). `frontier` runs the newer LoRA
# methods (server optimisers, RoLoRA, SLoRA, FedRot-LoRA, ILoRA, RAVAN, FedDPA,
# FedLEASE, HiLoRA, FedAsync, FedBuff) and FedIT on the same task, 5 seeds, and
# tables them with each method's paired difference to FedIT (about 70 min
# more; not default).
#
#   bash benchmarks/results.sh [NAME ...]     # default: every sweep
#   ENGINE=flwr bash benchmarks/results.sh    # through `flwr run` instead
#
# ENGINE=inprocess (the default here) runs the same ServerApp and ClientApp in
# one process: the same numbers as `flwr run`, without a Ray start-up per run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ENGINE=${ENGINE:-inprocess}
OUT=${OUT:-outputs/results}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_HOME=${FLWR_HOME:-$PWD/.flwr}
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

sweep() {  # NAME CONF METHODS SEEDS [SET]
    local name=$1 conf=$2 methods=$3 seeds=$4 set=${5:-}
    local args=(run --conf "$conf" --methods "$methods" --seeds "$seeds"
                --out "$OUT/$name" --engine "$ENGINE")
    [[ -n $set ]] && args+=(--set "$set")
    echo "== $name: $methods x seeds $seeds ${set:+($set)}"
    "$PY" -m fedlr.launch.compare "${args[@]}" || echo "== $name: some runs failed (see table.md)"
}

publish() {  # NAME: copy the sweep's table and plots into docs/results/NAME/
    mkdir -p "docs/results/$1"
    cp "$OUT/$1"/table.{md,csv} "$OUT/$1"/*.png "docs/results/$1/"
    [[ -f $OUT/$1/claims.md ]] && cp "$OUT/$1/claims.md" "docs/results/$1/"
    [[ -f $OUT/$1/paired.md ]] && cp "$OUT/$1"/paired.{md,csv} "docs/results/$1/"
    return 0
}

LORA=fedavg-lora,fedex-lora,ffa-lora,fedsvd,fedspec,fedsa-lora
PRIVATE=fedavg-lora,ffa-lora,fedsvd,fedex-lora,fedspec
FRONTIER=fedadam-lora,fedyogi-lora,fedadagrad-lora,rolora,slora,fedrot-lora,ilora
FRONTIER+=,ravan,feddpa,fedlease
run_one() {
    case $1 in
    lora-dirichlet) sweep lora-dirichlet benchmarks/conf/lora-family.toml $LORA 0,1,2 ;;
    lora-iid) sweep lora-iid benchmarks/conf/lora-family.toml $LORA 0,1,2 'partitioner="iid"' ;;
    vera) sweep vera benchmarks/conf/vera-family.toml fedavg-vera,vera-fedex,sorf-vera 0,1,2 ;;
    llm) sweep llm benchmarks/conf/llm-offline.toml \
        fedavg-lora,fedex-lora,fedspec,ffa-lora,fedsa-lora 0,1,2 ;;
    qrmix) sweep qrmix benchmarks/conf/qrmix-mnist.toml fedavg,qrmix 0,1,2 ;;
    fot)
        sweep fot benchmarks/conf/fot-permuted-mnist.toml fot,fedavg-continual 0,1,2
        for m in fot fedavg-continual; do  # seed 0's accuracy matrix of each
            cp "$OUT"/fot/runs/$m-seed0/*/accuracy_matrix.png \
                "$OUT/fot/accuracy_matrix-$m-seed0.png"
        done ;;
    svd)  # one sweep per rank, then one table over all of them
        for r in 3 4 5 6; do
            sweep "svd-rank$r" benchmarks/conf/global-local-svd.toml \
                global-svd,local-svd 0 "lora-rank=$r lora-alpha=$((2 * r)).0"
        done
        "$PY" -m fedlr.launch.compare table "$OUT"/svd-rank*/runs/*/*/ \
            --by lora-rank --out "$OUT/svd" >/dev/null ;;
    frontier)  # the newer methods on lora-dirichlet's task, beside FedIT, 5 seeds
        local five=0,1,2,3,4
        sweep frontier-fedit benchmarks/conf/lora-family.toml fedavg-lora $five
        sweep frontier benchmarks/conf/lora-family.toml $FRONTIER $five
        # HiLoRA's default stages (15 root, 20 cluster rounds) would leave a
        # 6-round run root-only: 2 rounds per stage here
        sweep frontier-hilora benchmarks/conf/lora-family.toml hilora $five \
            'hilora-root-rounds=2 hilora-cluster-rounds=2'
        # asynchronous, all 4 nodes busy on the generated 10x-spread trace, the
        # same 24 client trainings as 6 synchronous rounds: FedBuff K = 4 over
        # 6 versions; FedAsync 24 versions, lr-decay 0.85 per 4 of them
        sweep frontier-fedbuff benchmarks/conf/lora-family.toml fedbuff-lora $five \
            'buffer-size=4'
        sweep frontier-fedasync benchmarks/conf/lora-family.toml fedasync-lora $five \
            'num-server-rounds=24 lr-decay=0.9602'
        "$PY" -m fedlr.launch.compare table "$OUT"/frontier*/runs/*/*/ \
            --out "$OUT/frontier" >/dev/null
        "$PY" -m benchmarks.frontier "$OUT"/frontier*/runs/*/*/ \
            --out "$OUT/frontier" >/dev/null ;;
    privacy)  # DP-SGD at each epsilon; the no-DP runs are lora-dirichlet's
        # (publish copies table.md, table.csv and privacy.png; claims.md too)
        [[ -d $OUT/lora-dirichlet/runs ]] || run_one lora-dirichlet
        for e in 1 3 6; do
            sweep "privacy-eps$e" benchmarks/conf/privacy.toml $PRIVATE 0,1,2 \
                "dp-epsilon=$e.0"
        done
        local plain=()
        for m in ${PRIVATE//,/ }; do plain+=("$OUT"/lora-dirichlet/runs/$m-seed*/*/); done
        "$PY" -m benchmarks.privacy --out "$OUT/privacy" \
            "$OUT"/privacy-eps*/runs/*/*/ "${plain[@]}" ;;
    *) echo "unknown sweep '$1' (lora-dirichlet lora-iid vera llm qrmix fot svd privacy frontier)" >&2; exit 2 ;;
    esac
}

if (($# == 0)); then
    set -- lora-dirichlet vera llm qrmix fot svd lora-iid
fi
for name in "$@"; do run_one "$name" && publish "$name"; done
