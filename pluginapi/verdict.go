package pluginapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// The prefill verdict API is served by the prefill-side watchdog, not by
// the plugin: GET PathRoomVerdict + "<room>" answers what that watchdog
// knows of the room, so that a decode-side watchdog can tell whether the
// prefill peer has stopped sending (docs/decode.md).
const PathRoomVerdict = "/api/v1/rooms/"

// Verdicts of the prefill side on one room.
const (
	// VerdictStopped: the prefill watchdog released the room with no
	// chunk in flight (at the last listing and at the re-read) and the
	// room was never listed as an orphaned transfer since.
	VerdictStopped = "stopped"
	// VerdictLive: the room was released, but a chunk of it may still be
	// written (in flight at release, or listed as an orphan since).
	VerdictLive = "live"
	// VerdictInQueue: a prefill inflight listing still holds the room.
	VerdictInQueue = "in_queue"
	// VerdictUnknown: this watchdog knows nothing of the room.
	VerdictUnknown = "unknown"
)

// RoomVerdict is the body of a verdict answer. Room is a decimal string,
// so that clients in any language keep all 64 bits.
type RoomVerdict struct {
	Room    string `json:"room"`
	Verdict string `json:"verdict"`
	// ReleasedUnix is when the room was released (stopped, live).
	ReleasedUnix float64 `json:"released_unix,omitempty"`
	Reason       string  `json:"reason,omitempty"`
}

// maxVerdictBytes caps a verdict body: a few hundred bytes in practice.
const maxVerdictBytes = 4096

// FetchVerdict asks the watchdog at base (e.g. http://10.0.0.7:9433) for its
// verdict on room. Any error or unexpected answer is an error: the caller
// must then treat the transfer as possibly live.
func FetchVerdict(ctx context.Context, client *http.Client, base string, room uint64) (RoomVerdict, error) {
	url := strings.TrimRight(base, "/") + PathRoomVerdict + strconv.FormatUint(room, 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: %w", url, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxVerdictBytes+1))
	if err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: reading body: %w", url, err)
	}
	if len(body) > maxVerdictBytes {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: body exceeds %d bytes", url, maxVerdictBytes)
	}
	if resp.StatusCode != http.StatusOK {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: HTTP %d: %s", url, resp.StatusCode, snippet(body))
	}
	var v RoomVerdict
	if err := json.Unmarshal(body, &v); err != nil {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: malformed verdict: %w", url, err)
	}
	if v.Room != strconv.FormatUint(room, 10) {
		return RoomVerdict{}, fmt.Errorf("prefill watchdog %s: verdict for room %q, asked for %d", url, v.Room, room)
	}
	switch v.Verdict {
	case VerdictStopped, VerdictLive, VerdictInQueue, VerdictUnknown:
		return v, nil
	}
	return RoomVerdict{}, errors.New("prefill watchdog " + url + ": unknown verdict " + strconv.Quote(v.Verdict))
}
