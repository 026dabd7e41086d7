package watchdog

import "time"

// The watchdog's defaults, in one place: New applies those a zero Config
// field stands for, and the command line's flags read all of them.

// Defaults of the watch cycle and the stall rule (docs/runbook.md).
const (
	// DefaultInterval is how often the plugin listings are read and
	// decisions made.
	DefaultInterval = time.Second
	// DefaultDeadline: a prefill request younger than this is never stuck.
	DefaultDeadline = 60 * time.Second
	// DefaultStallWindow: a request is stuck only if nothing of it moved
	// for this long while the scheduler loop ran; also the wedged-loop
	// window.
	DefaultStallWindow = 30 * time.Second
	// DefaultPinWindow: a queue gauge non-zero and unchanged this long,
	// with no progress counter moving, is pinned.
	DefaultPinWindow = 2 * time.Minute
	// DefaultMaxRooms bounds the inflight requests remembered at once.
	DefaultMaxRooms = 100000
)

// Defaults of the transfer liveness rules (docs/runbook.md, "Transfer
// liveness", says why).
const (
	// DefaultLinkMargin: a live chunk is judged stuck only after 200 times
	// what its size needs at the slow end of the measured link, so a link
	// must fall below 0.5% of that speed for a healthy chunk to be taken for
	// a stuck one; and even then, never before the deadline. 100 was tried:
	// a link at 1% for every queue, with the chunks' ordinary spread, put a
	// few healthy chunks past it (bench/quality -family slowlink, BENCHMARKS.md).
	DefaultLinkMargin = 200
	// DefaultLinkIdle: a link that neither finished nor held a chunk for
	// this long is forgotten, and its next chunk gets the first-chunk
	// rule. A decode instance that comes back after that may well be
	// another machine behind the same address.
	DefaultLinkIdle = 30 * time.Minute
	// DefaultFailFastMinAge: a wedge order never fails a room younger than
	// this. A room that just arrived may have been queued after the chunk
	// it waits behind finished, in the same scheduler pass that the
	// listing was read in; two seconds is several listing intervals and
	// scheduler passes, and costs a doomed room nothing noticeable.
	DefaultFailFastMinAge = 2 * time.Second
)

// Defaults of the actuator's rails (docs/design.md, "Rate limits").
const (
	// DefaultMaxPerMinute bounds the prefill requests force-failed after
	// their deadline over any 60 s.
	DefaultMaxPerMinute = 6
	// DefaultFailFastPerMinute bounds the new wedge orders over any 60 s;
	// renewals are free.
	DefaultFailFastPerMinute = 180
	// DefaultConfirmTimeout is how long a release may take to be confirmed
	// before it counts as unconfirmed.
	DefaultConfirmTimeout = 60 * time.Second
	// DefaultAdminTimeout bounds one admin call: longer than the 5 s the
	// plugin waits for its scheduler.
	DefaultAdminTimeout = 7 * time.Second
	// DefaultRestartMinInterval is the least time between two restarts of
	// one pod.
	DefaultRestartMinInterval = 30 * time.Minute
	// defaultMaxAttempts bounds the admin calls per request that end in
	// error; retries back off exponentially from defaultRetryBackoff.
	defaultMaxAttempts  = 3
	defaultRetryBackoff = 10 * time.Second
)

// Defaults of the decode side (docs/decode.md says why).
const (
	// DefaultDecodeDeadline sits above the slowest healthy transfer of the
	// benchmark trace (153 s) and about twice the point at which the
	// prefill watchdog releases a pinned room (deadline 60 s + stall
	// window 30 s), and well below SGLang's own 300 s waiting timeout.
	DefaultDecodeDeadline = 180 * time.Second
	// DefaultLedgerTTL outlasts SGLang's decode waiting timeout (300 s)
	// plus its deferred release (30 s) with room to spare: by then decode
	// has released the request itself.
	DefaultLedgerTTL = 15 * time.Minute
	// DefaultLedgerSize bounds the ledger: 15 minutes at the default rate
	// limit (6 a minute) plus fail-fast (180 a minute) is under 3,000.
	DefaultLedgerSize = 10000
	// DefaultDecodePerMinute matches the prefill side's fail-fast budget:
	// every room prefill fails fast leaves its decode request stranded, to
	// be released here at the decode deadline, so the decode budget keeps
	// up with that inflow.
	DefaultDecodePerMinute = DefaultFailFastPerMinute
)
