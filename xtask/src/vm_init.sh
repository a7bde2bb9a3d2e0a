#!/bin/sh
# PID 1 of the kTLS VM test (see vm.rs). The host's root is mounted read-only; all
# writes go to a tmpfs mounted on $VM/scratch (inside our own tree, so it can never
# hide the checkout, wherever that lies). One `VMTEST ok|FAIL <check>` line per check,
# then VMTEST-DONE.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
BB=@BUSYBOX@
VM=@VM@
WEBSHIP=@WEBSHIP@
LEN=@FIXTURE_LEN@
FIX=$VM/www/fixture.bin
mount -t proc proc /proc
mount -t sysfs sys /sys
T=$VM/scratch
mount -t tmpfs -o size=128m tmpfs "$T"
$BB ip link set lo up
export HOME=$T TMPDIR=$T

pass() { echo "VMTEST ok $1"; }
fail() { echo "VMTEST FAIL $1 $2"; }
check() { name=$1; shift; if "$@"; then pass "$name"; else fail "$name"; fi; }

# HTTP/1.1: only its bulk path moves to kernel TLS (curl would pick h2 by ALPN).
CURL="curl -s --http1.1 --cacert $VM/cert.pem"
WANT=$(sha256sum "$FIX" | cut -d' ' -f1)

# start NAME PORT: serve $VM/NAME.toml, wait until it answers
start() {
    WEBSHIP_LOG=info,webship=debug "$WEBSHIP" serve --config "$VM/$1.toml" > "$T/$1.out" 2> "$T/$1.log" &
    echo $! > "$T/$1.pid"
    i=0
    while [ $i -lt 100 ]; do
        $CURL -o /dev/null "https://localhost:$2/small.txt" && return 0
        sleep 0.1
        i=$((i + 1))
    done
    echo "server $1 did not start:"; cat "$T/$1.log"
    return 1
}

stop() {
    kill -TERM "$(cat $T/$1.pid)" 2>/dev/null
    i=0
    while [ $i -lt 100 ] && kill -0 "$(cat $T/$1.pid)" 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
}

sha_of() { "$@" | sha256sum | cut -d' ' -f1; }

# --- negative control: the tls module is not loaded yet -----------------------------
if "$WEBSHIP" serve --config "$VM/required.toml" > $T/neg.out 2> $T/neg.log; then
    fail required-without-ktls-refuses "it served"
else
    check required-without-ktls-refuses grep -q "modprobe tls" $T/neg.log
fi
if start auto 8444; then
    check auto-without-ktls-serves-exact [ "$(sha_of $CURL https://localhost:8444/fixture.bin)" = "$WANT" ]
    check auto-without-ktls-says-so grep -q "ktls  \[auto\] missing" $T/auto.log
    stop auto
else
    fail auto-without-ktls-serves-exact "no start"
fi

# --- with kTLS ---------------------------------------------------------------------
for module in @MODULES@; do $BB insmod "$module" || echo "insmod $module failed"; done
check tls-module-loaded [ -e /proc/net/tls_stat ]
"$WEBSHIP" preflight --config "$VM/required.toml" > $T/preflight.txt 2>&1
check preflight-lists-suites grep -q "TLS1.2 CHACHA20-POLY1305" $T/preflight.txt
cat $T/preflight.txt | sed 's/^/VMTEST-INFO /'

if ! start required 8443; then
    fail required-starts ""
    echo VMTEST-DONE
    $BB poweroff -f
fi
URL=https://localhost:8443/fixture.bin
for suite in \
    "tls13-aes128 --tlsv1.3 --tls13-ciphers TLS_AES_128_GCM_SHA256" \
    "tls13-aes256 --tlsv1.3 --tls13-ciphers TLS_AES_256_GCM_SHA384" \
    "tls13-chacha20 --tlsv1.3 --tls13-ciphers TLS_CHACHA20_POLY1305_SHA256" \
    "tls12-aes128 --tlsv1.2 --tls-max 1.2 --ciphers ECDHE-ECDSA-AES128-GCM-SHA256" \
    "tls12-aes256 --tlsv1.2 --tls-max 1.2 --ciphers ECDHE-ECDSA-AES256-GCM-SHA384" \
    "tls12-chacha20 --tlsv1.2 --tls-max 1.2 --ciphers ECDHE-ECDSA-CHACHA20-POLY1305"; do
    set -- $suite
    name=$1; shift
    check "fixture-exact-$name" [ "$(sha_of $CURL "$@" $URL)" = "$WANT" ]
done
# The same with rustls as the client.
for version in tls13 tls12; do
    for cipher in aes128 aes256 chacha20; do
        got=$(@FETCH@ 127.0.0.1:8443 localhost /fixture.bin "$VM/cert.pem" $version $cipher)
        check "rustls-client-exact-$version-$cipher" [ "$got" = "200 $LEN $WANT" ]
    done
done
promoted=$(grep -c "promoted to kernel TLS" $T/required.log)
check twelve-downloads-promoted [ "$promoted" -ge 12 ]
tx=$(awk '/^TlsTxSw /{print $2}' /proc/net/tls_stat)
rx=$(awk '/^TlsRxSw /{print $2}' /proc/net/tls_stat)
echo "VMTEST-INFO tls_stat TlsTxSw=$tx TlsRxSw=$rx promotions-logged=$promoted"
check kernel-tls-tx-and-rx-used [ "$tx" -ge 12 ] && [ "$rx" -ge 12 ]

# Two requests on one promoted connection: the second is read by the kernel's RX.
$CURL -w '%{num_connects} %{size_download}\n' -o /dev/null $URL -o $T/small.out \
    https://localhost:8443/small.txt > $T/keepalive.txt
check keepalive-one-connection [ "$(tr '\n' ' ' < $T/keepalive.txt)" = "1 $LEN 0 26 " ]
check keepalive-second-body-exact cmp -s $T/small.out "$VM/www/small.txt"
echo "VMTEST-INFO keepalive: $(tr '\n' ' ' < $T/keepalive.txt)"

# The same two requests pipelined on one raw TLS connection: after the promoted
# fixture, the second response must start with its status line, not with its body.
printf 'GET /fixture.bin HTTP/1.1\r\nHost: localhost\r\n\r\nGET /small.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' |
    timeout 60 openssl s_client -quiet -ign_eof -connect 127.0.0.1:8443 -servername localhost \
        -CAfile "$VM/cert.pem" 2> /dev/null > $T/pipelined.out
echo "VMTEST-INFO pipelined: $(wc -c < $T/pipelined.out) bytes, last 240: $(tail -c 240 $T/pipelined.out | tr '\r\n' '<>')"
check promoted-second-response-head-before-body \
    [ "$(tail -c 26 $T/pipelined.out)" = "small and after promotion" ]

# Two multipart range responses on one connection: the first promotes to kernel TLS
# halfway through its first range; the second starts on the promoted socket, and
# after its first range (over 1 MiB, sent by sendfile) its next part header must not
# start a second promotion, which would drop the kernel stream mid-response.
RANGES=0-1499999,2000000-2000099
$CURL -r $RANGES -w '%{num_connects} %{size_download}\n' -o $T/multi1.out $URL \
    -o $T/multi2.out $URL > $T/multi.txt
multi_rc=$?
echo "VMTEST-INFO multipart-twice rc=$multi_rc $(tr '\n' ' ' < $T/multi.txt)"
check multipart-on-promoted-connection-completes [ "$multi_rc" -eq 0 ]
check multipart-on-promoted-connection-same-length \
    [ "$(wc -c < $T/multi1.out)" -eq "$(wc -c < $T/multi2.out)" ]

# A range above 1 MiB is promoted too, and exact.
want_range=$(tail -c +2000001 "$FIX" | head -c 58000001 | sha256sum | cut -d' ' -f1)
check range-above-1mib-exact [ "$(sha_of $CURL -r 2000000-60000000 $URL)" = "$want_range" ]

# A client that leaves mid-sendfile: the server lets go and keeps serving.
$CURL --limit-rate 20M --max-time 1 -o /dev/null $URL
established() { awk '$2 ~ /:20FB$/ && $4 == "01"' /proc/net/tcp | wc -l; }
i=0
while [ $i -lt 50 ] && [ "$(established)" -gt 0 ]; do sleep 0.1; i=$((i + 1)); done
check disconnect-mid-sendfile-releases [ "$(established)" -eq 0 ]
check serves-after-disconnect [ "$($CURL https://localhost:8443/small.txt)" = "small and after promotion" ]

# The same promotions in /metrics (docs/metrics.md) on the admin listener: one per
# promotion logged, none lost, and each moved the rest of its body (all but the
# first MiB or so) with sendfile.
curl -s --max-time 10 http://127.0.0.1:9901/metrics > $T/metrics.txt
series() { awk -v s="$1" '$1 == s {print $2}' $T/metrics.txt; }
m_kernel=$(series 'webship_ktls_promotions_total{result="kernel"}')
m_stayed=$(series 'webship_ktls_promotions_total{result="stayed"}')
m_lost=$(series 'webship_ktls_promotions_total{result="lost"}')
m_sent=$(series webship_ktls_sendfile_bytes_total)
logged=$(grep -c "promoted to kernel TLS" $T/required.log)
echo "VMTEST-INFO metrics: promotions kernel=$m_kernel stayed=$m_stayed lost=$m_lost sendfile_bytes=$m_sent logged=$logged"
check metrics-promotions-as-logged [ "${m_kernel:-0}" -ge 12 -a "${m_kernel:-0}" -eq "$logged" ]
check metrics-no-promotion-lost [ "${m_lost:-x}" = 0 ]
check metrics-sendfile-bytes [ "${m_sent:-0}" -ge $((12 * (LEN - 2097152))) ]

stop required
check counters-logged grep -q "ktls counters promotions=" $T/required.log
grep "ktls counters" $T/required.log | sed 's/^.*ktls counters/VMTEST-INFO ktls counters/'

# --- throughput and server CPU, promotion on versus off -------------------------------
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
measure() { # NAME PORT
    start "$1" "$2" || return
    pid=$(cat "$T/$1.pid")
    t0=$(ticks "$pid")
    total=0
    for n in 1 2 3; do
        s=$($CURL -o /dev/null -w '%{time_total}' "https://localhost:$2/fixture.bin")
        total=$(awk -v a="$total" -v b="$s" 'BEGIN{print a + b}')
    done
    t1=$(ticks "$pid")
    awk -v t="$total" -v c=$((t1 - t0)) -v len="$LEN" -v name="$1" \
        'BEGIN{printf "VMTEST-PERF ktls=%s MiB/s=%.1f server-cpu-s/GB=%.3f\n", name, 3*len/t/1048576, c/100/(3*len/1e9)}'
    stop "$1"
}
measure required 8443
measure off 8445

echo VMTEST-DONE
$BB poweroff -f
