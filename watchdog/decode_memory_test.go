package watchdog

import (
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// Issue 18: a prealloc request waiting for decode memory (handshake done,
// no pages free) is not stuck: SGLang never times it out, and releasing it
// at the decode deadline is harsher than stock under decode overload. A
// prealloc request stuck in bootstrap still is.
func TestDecodePreallocWaitingForMemoryIsNeverReleased(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	waiting := dreq("waiting", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false))
	waiting.WaitingForMemory = true
	d.set(waiting, dreq("bootstrapping", 12, pluginapi.DecodeQueuePrealloc, pluginapi.PollBootstrapping, 100, boolp(false)))
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, nil)
	h.tick(79)
	if got := h.rank(RoleDecode).Stuck; got != 0 {
		t.Fatalf("%d stuck before the decode deadline", got)
	}
	h.tick(1)
	if got := h.rank(RoleDecode).Stuck; got != 1 {
		t.Fatalf("%d stuck at the decode deadline, want only the request stuck in bootstrap", got)
	}
	h.tick(120)
	if o := d.orders(); len(o) != 1 || o[0].RID != "bootstrapping" {
		t.Fatalf("orders %+v, want only the request stuck in bootstrap released", o)
	}
}

// A request that starts waiting for memory between the decision and the
// call is not released: the re-read cancels it.
func TestDecodeRereadCancelsWhenWaitingForMemory(t *testing.T) {
	d := newFakeDecode("http://127.0.0.1:30200", 0)
	d.set(dreq("r", 11, pluginapi.DecodeQueuePrealloc, pluginapi.PollWaitingForInput, 100, boolp(false)))
	h := newDecodeHarness(t, nil, []*fakeDecode{d}, nil)
	h.tick(79)
	d.mu.Lock()
	reread := d.reads + 2 // the cycle's listing, then the re-read before the call
	d.beforeRead = func(read int) {
		if read == reread {
			d.update("r", func(r *pluginapi.DecodeRequest) { r.WaitingForMemory = true })
		}
	}
	d.mu.Unlock()
	h.tick(1)
	if o := d.orders(); len(o) != 0 || h.skips(SkipProgressed) != 1 {
		t.Fatalf("orders %+v, %d progressed; want the call cancelled at the re-read", o, h.skips(SkipProgressed))
	}
}
