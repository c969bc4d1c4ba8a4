// Package trace generates synthetic LLM serving traces for cache
// simulations, benchmarks and demos: shared system prompts with Zipf
// popularity, multi-turn conversations whose every turn extends the previous
// prefix, and one-off long documents that scan through the cache. A trace is
// a deterministic function of its Config (seed included).
package trace

import (
	"errors"
	"fmt"
	"math/rand/v2"
)

// Kind says what produced a request.
type Kind uint8

// Request kinds.
const (
	// NewConversation: a system prompt and a first user turn.
	NewConversation Kind = iota + 1
	// Turn: a later turn of a conversation; its tokens extend the previous
	// turn's tokens (with the reply in between).
	Turn
	// Document: a system prompt and a long one-off document.
	Document
)

func (k Kind) String() string {
	switch k {
	case NewConversation:
		return "new-conversation"
	case Turn:
		return "turn"
	case Document:
		return "document"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Request is one prompt sent to the serving stack.
type Request struct {
	Seq          int // position in the trace, from 0
	Kind         Kind
	Conversation int // conversation id (Document: -1)
	Tokens       []uint32
}

// Config shapes a trace.
type Config struct {
	Seed uint64
	// SystemPrompts of SystemTokens tokens each, chosen with Zipf
	// popularity of exponent ZipfS (> 1).
	SystemPrompts int
	SystemTokens  int
	ZipfS         float64
	// ActiveConversations is how many conversations are open at once; a new
	// one replaces a random open one.
	ActiveConversations int
	// TurnTokens is the mean length of a user turn or a reply; MaxTurns ends
	// a conversation.
	TurnTokens int
	MaxTurns   int
	// DocumentTokens is the length of a one-off document.
	DocumentTokens int
	// Probabilities of a request being a new conversation or a document; the
	// rest are turns of open conversations.
	PNewConversation float64
	PDocument        float64
	// Vocab bounds token ids.
	Vocab uint32
}

// Default is a trace with 64 system prompts of 1024 tokens (Zipf 1.1), 256
// open conversations of up to 8 turns of about 256 tokens, and 10% one-off
// documents of 8192 tokens.
var Default = Config{
	SystemPrompts: 64, SystemTokens: 1024, ZipfS: 1.1,
	ActiveConversations: 256, TurnTokens: 256, MaxTurns: 8,
	DocumentTokens: 8192, PNewConversation: 0.25, PDocument: 0.1, Vocab: 128000,
}

// ErrConfig: an invalid Config.
var ErrConfig = errors.New("trace: invalid config")

// Generator produces the requests of one trace, in order. Not safe for
// concurrent use.
type Generator struct {
	cfg     Config
	rng     *rand.Rand
	zipf    *rand.Zipf
	systems [][]uint32
	convs   []conversation
	nextID  int
	seq     int
}

type conversation struct {
	id     int
	turns  int
	tokens []uint32
}

// New returns a generator for cfg; start from Default and change what
// matters (a Seed, at least).
func New(cfg Config) (*Generator, error) {
	switch {
	case cfg.SystemPrompts < 1 || cfg.SystemTokens < 1 || cfg.ActiveConversations < 1 ||
		cfg.TurnTokens < 1 || cfg.MaxTurns < 1 || cfg.DocumentTokens < 1 || cfg.Vocab < 1:
		return nil, fmt.Errorf("%w: every size must be at least 1 in %+v", ErrConfig, cfg)
	case cfg.ZipfS <= 1:
		return nil, fmt.Errorf("%w: ZipfS %v must be > 1", ErrConfig, cfg.ZipfS)
	case cfg.PNewConversation < 0 || cfg.PDocument < 0 || cfg.PNewConversation+cfg.PDocument > 1:
		return nil, fmt.Errorf("%w: probabilities %v + %v must be in [0, 1]", ErrConfig, cfg.PNewConversation, cfg.PDocument)
	}
	g := &Generator{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x5851f42d4c957f2d))}
	g.zipf = rand.NewZipf(g.rng, cfg.ZipfS, 1, uint64(cfg.SystemPrompts-1))
	for range cfg.SystemPrompts {
		g.systems = append(g.systems, g.tokens(cfg.SystemTokens))
	}
	return g, nil
}

func (g *Generator) tokens(n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = g.rng.Uint32N(g.cfg.Vocab)
	}
	return t
}

// turnLen draws a turn length uniform in [TurnTokens/2, 3×TurnTokens/2].
func (g *Generator) turnLen() int {
	return g.cfg.TurnTokens/2 + g.rng.IntN(g.cfg.TurnTokens+1)
}

func (g *Generator) system() []uint32 { return g.systems[g.zipf.Uint64()] }

// Next returns the next request. Its Tokens are its own (never aliased by a
// later request).
func (g *Generator) Next() Request {
	r := Request{Seq: g.seq}
	g.seq++
	p := g.rng.Float64()
	switch {
	case p < g.cfg.PDocument:
		r.Kind, r.Conversation = Document, -1
		r.Tokens = append(append([]uint32(nil), g.system()...), g.tokens(g.cfg.DocumentTokens)...)
		return r
	case p < g.cfg.PDocument+g.cfg.PNewConversation || len(g.convs) == 0:
		c := conversation{id: g.nextID, turns: 1}
		g.nextID++
		c.tokens = append(append([]uint32(nil), g.system()...), g.tokens(g.turnLen())...)
		if len(g.convs) < g.cfg.ActiveConversations {
			g.convs = append(g.convs, c)
		} else {
			g.convs[g.rng.IntN(len(g.convs))] = c
		}
		r.Kind, r.Conversation = NewConversation, c.id
		r.Tokens = append([]uint32(nil), c.tokens...)
		return r
	}
	i := g.rng.IntN(len(g.convs))
	c := &g.convs[i]
	c.tokens = append(c.tokens, g.tokens(2*g.turnLen())...) // reply + next user turn
	c.turns++
	r.Kind, r.Conversation = Turn, c.id
	r.Tokens = append([]uint32(nil), c.tokens...)
	if c.turns >= g.cfg.MaxTurns {
		g.convs[i] = g.convs[len(g.convs)-1]
		g.convs = g.convs[:len(g.convs)-1]
	}
	return r
}
