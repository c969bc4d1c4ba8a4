// Command kvoffload shows the offload engine at work and measures it.
//
//	kvoffload demo   a serving simulation through the public offload API,
//	                 with every loaded block verified
//	kvoffload bench  the copy-method sweep and the pinning comparison, written
//	                 as CSV, JSON and an SVG plot (needs a GPU)
//	kvoffload info   driver, devices, PCIe links, NUMA, huge pages, memlock
//	                 and cgroup limits, and the backend "auto" would pick
//	kvoffload serve  a node pool: one pool and block index shared by the
//	                 processes of a machine (package nodepool)
//	kvoffload version
//	                 the release version (internal/version/VERSION) and the
//	                 commit the binary was built from (also --version)
//
// Every command takes --help and --json. Sizes take units (4096, 64KiB,
// 1GiB, 2G, 100GB). Errors go to stderr; the exit status is 0 on success,
// 1 on a runtime error, 2 on bad usage, 3 when the demo finds a block
// whose content is wrong or a bench run is invalid (a row faster than the
// link reference), and 130 (SIGINT, Ctrl-C) or 143 (SIGTERM) when a
// signal interrupted the command, which then reports what ran, marked
// interrupted (a wrong block found before still exits 3). A second signal
// ends the process at once.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
)

// Exit statuses.
const (
	exitOK     = 0
	exitError  = 1
	exitUsage  = 2
	exitVerify = 3
)

// errUsage marks errors caused by the command line (exit status 2).
var errUsage = errors.New("usage")

// errVerification marks a demo whose verification found a wrong block, or
// a bench run whose rows contradict its link reference (exit status 3).
var errVerification = errors.New("verification failed")

// env is what a command runs with: its output streams and whether stderr
// is a terminal (for the progress bar).
type env struct {
	stdout, stderr io.Writer
	stderrIsTTY    bool
}

// command is one subcommand.
type command struct {
	name    string
	summary string
	// flags registers the command's flags and returns the function that
	// runs it once they are parsed.
	flags func(fs *flag.FlagSet) func(ctx context.Context, e *env, args []string) error
	// details is printed in --help between the synopsis and the flags.
	details string
}

var commands = map[string]command{
	"demo":    demoCommand,
	"soak":    soakCommand,
	"bench":   benchCommand,
	"info":    infoCommand,
	"serve":   serveCommand,
	"version": versionCommand,
}

// interruption is the cause of a command's context ending on a signal.
type interruption struct{ sig syscall.Signal }

func (i interruption) Error() string { return "interrupted by " + i.sig.String() }

// exitStatus is the shell's status for a process ended by the signal.
func (i interruption) exitStatus() int { return 128 + int(i.sig) }

// interrupted returns the signal that ended ctx, if one did.
func interrupted(ctx context.Context) (interruption, bool) {
	var i interruption
	ok := errors.As(context.Cause(ctx), &i)
	return i, ok
}

func main() {
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 1)
	signals := []os.Signal{os.Interrupt, syscall.SIGTERM}
	signal.Notify(sigs, signals...)
	go func() {
		s := <-sigs
		// The next signal takes its default action: a second Ctrl-C ends
		// a command that is slow to stop.
		signal.Reset(signals...)
		cancel(interruption{s.(syscall.Signal)})
	}()
	code := run(ctx, os.Args[1:], &env{stdout: os.Stdout, stderr: os.Stderr, stderrIsTTY: isTerminal(os.Stderr)})
	os.Exit(code)
}

// run runs the command line args and returns the exit status.
func run(ctx context.Context, args []string, e *env) int {
	if len(args) == 0 {
		usage(e.stderr)
		return exitUsage
	}
	name := args[0]
	switch name {
	case "--version":
		name = "version"
	case "-h", "-help", "--help", "help":
		if len(args) > 1 {
			if c, ok := commands[args[1]]; ok {
				fs, _ := newFlagSet(c)
				commandUsage(e.stdout, c, fs)
				return exitOK
			}
			fmt.Fprintf(e.stderr, "kvoffload: unknown command %q\n", args[1])
			return exitUsage
		}
		usage(e.stdout)
		return exitOK
	}
	c, ok := commands[name]
	if !ok {
		fmt.Fprintf(e.stderr, "kvoffload: unknown command %q (commands: %s; see kvoffload --help)\n", name, strings.Join(commandNames(), ", "))
		return exitUsage
	}
	fs, runFn := newFlagSet(c)
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			commandUsage(e.stdout, c, fs)
			return exitOK
		}
		fmt.Fprintf(e.stderr, "kvoffload %s: %v (see kvoffload %s --help)\n", name, err, name)
		return exitUsage
	}
	err := runFn(ctx, e, fs.Args())
	sig, wasInterrupted := interrupted(ctx)
	switch {
	case err == nil && wasInterrupted:
		return sig.exitStatus()
	case err == nil:
		return exitOK
	case errors.Is(err, errUsage):
		fmt.Fprintf(e.stderr, "kvoffload %s: %v (see kvoffload %s --help)\n", name, err, name)
		return exitUsage
	case errors.Is(err, errVerification):
		fmt.Fprintf(e.stderr, "kvoffload %s: %v\n", name, err)
		return exitVerify
	case wasInterrupted:
		fmt.Fprintf(e.stderr, "kvoffload %s: %v\n", name, err)
		return sig.exitStatus()
	default:
		fmt.Fprintf(e.stderr, "kvoffload %s: %v\n", name, err)
		return exitError
	}
}

// newFlagSet builds c's flag set; parse errors are reported by run, not by
// the flag package.
func newFlagSet(c command) (*flag.FlagSet, func(context.Context, *env, []string) error) {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs, c.flags(fs)
}

func commandNames() []string {
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "kvoffload: a KV-cache CPU-offload engine — demo, benchmarks and machine facts.")
	fmt.Fprintln(w, "\nUsage: kvoffload <command> [flags]\n\nCommands:")
	for _, n := range commandNames() {
		fmt.Fprintf(w, "  %-7s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nRun kvoffload <command> --help for its flags. Sizes take units: 4096, 64KiB, 1GiB, 2G, 100GB.")
}

func commandUsage(w io.Writer, c command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: kvoffload %s [flags]\n\n%s\n", c.name, c.summary)
	if c.details != "" {
		fmt.Fprintf(w, "\n%s\n", strings.TrimSpace(c.details))
	}
	fmt.Fprintln(w, "\nFlags:")
	fs.VisitAll(func(f *flag.Flag) {
		arg, text := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if arg != "" {
			line += " " + arg
		}
		if def := f.DefValue; def != "" && def != "0" && def != "false" {
			text += " (default " + def + ")"
		}
		fmt.Fprintf(w, "%s\n      %s\n", line, text)
	})
}

// noArgs rejects positional arguments.
func noArgs(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, args[0])
	}
	return nil
}
