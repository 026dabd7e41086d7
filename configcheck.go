package main

import (
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// configOKMessage is what --config.check prints when every check passed.
const configOKMessage = "config OK"

// checkFiles runs the checks of --config.check that a normal start leaves
// to later: the web config (read when the server starts), the listen
// addresses (bound then), and the mode file, whose bad content at run time
// only keeps the current mode, so that a typo in a ConfigMap never stops a
// sidecar that holds SGLang's start.
func checkFiles(o *options) error {
	if f := *o.web.WebConfigFile; f != "" {
		if err := web.Validate(f); err != nil {
			return fmt.Errorf("--web.config.file %s: %w", f, err)
		}
	}
	for _, a := range *o.web.WebListenAddresses {
		if err := checkAddress("--web.listen-address", a); err != nil {
			return err
		}
	}
	if o.probeAddress != "" {
		if err := checkAddress("--web.probe-listen-address", o.probeAddress); err != nil {
			return err
		}
	}
	if f := o.watch.ModeFile; f != "" {
		if _, _, err := watchdog.ReadModeFile(f); err != nil {
			return fmt.Errorf("--force-fail.mode-file: %w", err)
		}
	}
	return nil
}

// checkAddress checks a listen address without binding it.
func checkAddress(flag, addr string) error {
	if strings.HasPrefix(addr, "vsock://") {
		return nil
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return fmt.Errorf("%s %q: %w", flag, addr, err)
	}
	return nil
}

// flagError names the flag whose value kingpin refused: kingpin says what
// is wrong with a value ("time: invalid duration") but not whose it is,
// and a sidecar's arguments come from a chart, far from the message. Each
// value is set again, in order, on a scratch set of options; the first
// refused names the flag (or its environment variable).
func flagError(args []string, err error) error {
	var scratch options
	app := newApp(&scratch)
	ctx, perr := app.ParseContext(args)
	if perr != nil {
		return err
	}
	for _, el := range ctx.Elements {
		f, ok := el.Clause.(*kingpin.FlagClause)
		if !ok || el.Value == nil {
			continue
		}
		if m := f.Model(); m.Value.Set(*el.Value) != nil {
			return fmt.Errorf("--%s=%s: %w", m.Name, *el.Value, err)
		}
	}
	model := app.Model()
	flags := model.Flags
	for _, c := range model.Commands {
		flags = append(flags, c.Flags...)
	}
	for _, m := range flags {
		if v, ok := os.LookupEnv(m.Envar); ok && m.Envar != "" && m.Value.Set(v) != nil {
			return fmt.Errorf("%s=%s (--%s): %w", m.Envar, v, m.Name, err)
		}
	}
	return err
}
