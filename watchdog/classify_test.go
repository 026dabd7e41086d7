package watchdog

import (
	"errors"
	"net/http"
	"testing"

	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

// A plugin answer that could be read as a release must only be one when the
// plugin says the lever is set: a pulled lever that did not take
// (lever_ineffective) leaves the request where it was.
func TestClassifyForceFailAnswers(t *testing.T) {
	cases := []struct {
		status int
		result string
		err    error
		want   string
	}{
		{http.StatusOK, pluginapi.ResultFlipped, nil, outAwait},
		{http.StatusOK, pluginapi.ResultAlreadyFailed, nil, outAwait},
		{http.StatusOK, pluginapi.ResultWouldFlip, nil, ResultWouldFlip},
		{http.StatusInternalServerError, pluginapi.ResultLeverIneffective, nil, ResultError},
		{http.StatusNotImplemented, pluginapi.ResultUnsupported, nil, ResultUnsupported},
		{http.StatusConflict, pluginapi.ResultTransferSucceeded, nil, outSucceeded},
		{http.StatusConflict, pluginapi.ResultHealthCheck, nil, ResultRejected},
		{http.StatusConflict, pluginapi.ResultGroupUnwatched, nil, ResultGroupUnwatched},
		{http.StatusNotFound, pluginapi.ResultNotFound, nil, ResultNotFound},
		{0, "", errors.New("connection refused"), ResultError},
	}
	for _, c := range cases {
		resp := &pluginapi.ForceFailResponse{Result: c.result}
		if got := classify(c.status, resp, c.err); got != c.want {
			t.Errorf("classify(%d, %q, %v) = %q, want %q", c.status, c.result, c.err, got, c.want)
		}
	}
}
